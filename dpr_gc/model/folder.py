"""Saved retrievers on disk: one folder that dpr-gc, sentence-transformers and transformers all load as it is.

Format 2 (written by :func:`save_retriever`), one shared tower::

    config.json, model.safetensors, tokenizer files   the transformer and its tokenizer (AutoModel / AutoTokenizer)
    modules.json, sentence_bert_config.json           sentence-transformers' pipeline: Transformer -> Pooling
    1_Pooling/, 2_Dense/, ...                         -> [Dense(tanh): BERT's pooler] -> [Dense: projection]
    config_sentence_transformers.json                 -> [Normalize]; prompts "query"/"document" = the prefixes
    retriever_config.json                             dpr-gc's RetrieverConfig, temperature and format_version
    heads.safetensors                                 the raw (log) temperature parameter, so training resumes exactly
    README.md                                         the model card

Separate towers: the same pipeline per tower inside a sentence-transformers ``Router`` (``query_N_*`` and
``document_N_*`` folders, ``router_config.json``), so ``encode_query`` / ``encode_document`` use the right tower.
Query and passage max lengths are the Transformer's ``query_length`` / ``document_length``. Weights are
safetensors only.

Also read: format 1 (``query_encoder/``, ``passage_encoder/``, ``tokenizer/``, ``projection.pt`` or
``heads.safetensors``), any
sentence-transformers folder, an official DPR ``DPRQuestionEncoder`` / ``DPRContextEncoder`` pair, and any Hugging
Face model.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file
from torch import nn

from ..base.errors import DprGcError
from ..base.files import atomic_path, read_json_list, read_json_object, read_tensors, write_json
from ..engine.loss import TEMPERATURE_RANGE
from .card import write_model_card
from .config import PASSAGE_FORMATS, POOLINGS, RetrieverConfig
from .dpr_hub import find_dpr_pair, load_dpr, one_tokenizer
from .pretrained import check_saveable, is_adapted, load_tokenizer, load_transformer
from .tokenize import lowercases, normalizers
from ..base.guard import ADAPTER_CONFIG, atomic_folder, check_outputs
from ..base.logs import transformers_quiet
from ..base.validate import (Field, check_fields, check_list, count, inside, no_lone_surrogates, number, one_of,
                             positive_int, text)

logger = logging.getLogger(__name__)

CONFIG_NAME = "retriever_config.json"
HEADS_NAME = "heads.safetensors"
TEMPERATURE_KEY = "temperature.log_value"
FORMAT_VERSION = 2
ST_PACKAGE = "sentence_transformers"
# The prompts a passage takes from a sentence-transformers folder, the first present (the order its
# encode_document documents).
DOCUMENT_PROMPTS = ("document", "passage", "corpus")
ST_TYPES = {"Transformer": "sentence_transformers.base.modules.transformer.Transformer",
            "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
            "Dense": "sentence_transformers.base.modules.dense.Dense",
            "Normalize": "sentence_transformers.base.modules.normalize.Normalize",
            "Router": "sentence_transformers.base.modules.router.Router"}
# the typed fields of each JSON file of a model folder that dpr-gc reads (see dpr_gc.base.validate)
MODULE_FIELDS = {"path": text(), "type": text(), "name": Field((str, int)), "idx": count()}
ROUTER_FIELDS = {"structure": Field(dict), "types": Field(dict)}
TRANSFORMER_FIELDS = {"max_seq_length": positive_int(True), "query_length": positive_int(True),
                      "document_length": positive_int(True), "do_lower_case": Field(bool)}
DENSE_FIELDS = {"in_features": positive_int(), "out_features": positive_int(), "bias": Field(bool),
                "activation_function": text(True)}
POOLING_FIELDS = {"pooling_mode": text(True), "embedding_dimension": positive_int(True),
                  "include_prompt": Field(bool),
                  **{f"pooling_mode_{m}": Field(bool) for m in ("cls_token", "mean_tokens", "lasttoken", "max_tokens",
                                                                "mean_sqrt_len_tokens", "weightedmean_tokens")}}
ST_FIELDS = {"prompts": Field(dict, True), "similarity_fn_name": text(True)}
RETRIEVER_FIELDS = {"format_version": Field(int), "pooling": one_of(POOLINGS), "normalize": Field(bool),
                    "projection_dim": positive_int(True), "shared_encoder": Field(bool),
                    "query_max_length": positive_int(), "passage_max_length": positive_int(),
                    "temperature": number(lambda v: TEMPERATURE_RANGE[0] <= v <= TEMPERATURE_RANGE[1],
                                          "a number from {} to {}".format(*TEMPERATURE_RANGE)),
                    "learn_temperature": Field(bool), "passage_format": one_of(PASSAGE_FORMATS),
                    "query_prefix": text(), "passage_prefix": text()}
# A foreign folder's max lengths (see config_from_pipeline): passages as sentence-transformers cuts them, else 256;
# queries at most 64 tokens unless the folder gives a query length.
DEFAULT_LENGTH, QUERY_LENGTH, NO_LIMIT = 256, 64, 10 ** 29
IDENTITY, TANH = "torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Tanh"
ROUTES = {"query": "query", "passage": "document"}


# What a model folder dpr-gc may replace whole consists of (format 2, format 1, a LoRA tower, a Hugging Face or
# sentence-transformers model): anything else in it is the user's, and the folder is refused rather than replaced.
MODEL_FILE = re.compile(r"(config|generation_config|modules|sentence_bert_config|config_sentence_transformers|"
                        r"retriever_config|router_config|adapter_config|tokenizer|tokenizer_config|"
                        r"special_tokens_map|added_tokens|vocab|model\.safetensors\.index|chat_template)\.json|"
                        r"(model|heads|adapter_model)\.safetensors|model-\d+-of-\d+\.safetensors|"
                        r"vocab\.txt|merges\.txt|(tokenizer|spiece|sentencepiece\.bpe)\.model|chat_template\.jinja|"
                        r"projection\.pt|README\.md")
MODEL_SUBFOLDER = re.compile(r"\d+_(Pooling|Dense|Normalize)|"
                             r"(query|document)_\d+_(Transformer|Pooling|Dense|Normalize)|"
                             r"query_encoder|passage_encoder|tokenizer")


# ------------------------------------------------------------------------------------------------------- writing
def save_retriever(retriever: Any, path: str | Path) -> None:
    """Write ``retriever`` as a format-2 folder (see the module docstring) with its model card, whole or not at all:
    it is written into a temporary sibling folder that then replaces ``path`` (see :func:`atomic_folder`). An
    existing non-empty folder is replaced only when it is a saved model and nothing else
    (:func:`check_replaceable`), and never when it is or holds a tower's LoRA base model folder
    (:func:`check_not_adapter_base`)."""
    target = Path(path)
    check_replaceable(target)
    check_not_adapter_base(retriever, target)
    with atomic_folder(target) as out:
        _write_retriever(retriever, out)


def check_replaceable(target: Path, flag: str = "--output") -> None:
    """Refuse a non-empty folder ``target`` unless it holds a model and only what a model folder consists of
    (:data:`MODEL_FILE` files, :data:`MODEL_SUBFOLDER` folders of such files): replaced whole, it would lose the
    user's files beside the model (a project holding a ``config.json``, notes, results)."""
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not any((target / name).is_file() for name in (CONFIG_NAME, "modules.json", "config.json")):
        raise DprGcError(f"{target} is a folder that holds no saved model; it would be replaced whole, so give a new "
                         "or empty folder")
    foreign = _foreign_entry(target, top=True)
    if foreign is not None:
        raise DprGcError(f"{target} holds {foreign}, which is no part of a saved model; the folder would be "
                         f"replaced whole, so choose another {flag} or move {foreign.name} out of it")


def check_not_adapter_base(retriever: Any, target: Path, flag: str = "save folder") -> None:
    """Refuse a ``target`` that is, lies inside or holds the local base model folder a LoRA tower's adapter names
    (``base_model_name_or_path``): the adapter saved there loads that folder, which saving would replace. The
    line is the one ``dpr-gc`` commands give for an output over an input (:func:`check_outputs`)."""
    shared = retriever.passage_encoder is retriever.query_encoder
    bases = {}
    for kind, encoder in (("query", retriever.query_encoder), ("passage", retriever.passage_encoder)):
        if is_adapted(encoder.transformer):
            base = encoder.transformer.peft_config["default"].base_model_name_or_path
            if isinstance(base, str) and base.strip() and Path(base).exists():
                bases[f"LoRA base model of the {'shared' if shared else kind} tower"] = base
    check_outputs(bases, {flag: target}, whole=(flag,))


def _foreign_entry(folder: Path, top: bool) -> Optional[Path]:
    """The first entry of ``folder`` (sorted) that no saved model folder holds, or None."""
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            return entry
        if entry.is_file() and MODEL_FILE.fullmatch(entry.name):
            continue
        if entry.is_dir() and top and MODEL_SUBFOLDER.fullmatch(entry.name):
            inner = _foreign_entry(entry, top=False)
            if inner is None:
                continue
            return inner
        return entry
    return None


def _write_retriever(retriever: Any, out: Path) -> None:
    config = retriever.config
    shared = retriever.passage_encoder is retriever.query_encoder
    if shared:
        modules = _write_tower(out, "", retriever.query_encoder, retriever.tokenizer, config.passage_max_length)
        write_json(out / "modules.json", [{"idx": i, "name": str(i), "path": folder, "type": ST_TYPES[kind]}
                                          for i, (folder, kind) in enumerate(modules)])
    else:
        routes = {}
        for kind, encoder in (("query", retriever.query_encoder), ("passage", retriever.passage_encoder)):
            limit = config.query_max_length if kind == "query" else config.passage_max_length
            routes[ROUTES[kind]] = _write_tower(out, ROUTES[kind], encoder, retriever.tokenizer, limit)
        write_json(out / "router_config.json", {
            "types": {folder: ST_TYPES[kind] for modules in routes.values() for folder, kind in modules},
            "structure": {route: [folder for folder, _ in modules] for route, modules in routes.items()},
            "parameters": {"default_route": "document", "allow_empty_key": True, "route_mappings": {}}})
        write_json(out / "modules.json", [{"idx": 0, "name": "0", "path": "", "type": ST_TYPES["Router"]}])
    write_json(out / "config_sentence_transformers.json", sentence_transformers_settings(config))
    with atomic_path(out / HEADS_NAME) as tmp:
        save_file({TEMPERATURE_KEY: retriever.tau.log_value.detach().cpu().clone()}, str(tmp))
    lo, hi = TEMPERATURE_RANGE
    saved = dataclasses.asdict(config)  # the JSON temperature is informative; float32 rounding may cross a bound
    saved.update(format_version=FORMAT_VERSION, shared_encoder=shared,
                 temperature=min(max(float(retriever.temperature.detach()), lo), hi))
    write_json(out / CONFIG_NAME, saved)
    write_model_card(out, retriever)


def sentence_transformers_settings(config: Any) -> dict:
    """``config_sentence_transformers.json``: prefixes as the "query"/"document" prompts, the similarity."""
    import transformers

    return {"__version__": {"sentence_transformers": _st_version(), "transformers": transformers.__version__,
                            "pytorch": torch.__version__},
            "model_type": "SentenceTransformer",
            "prompts": {"query": config.query_prefix, "document": config.passage_prefix},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine" if config.normalize else "dot"}


def _st_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("sentence-transformers")
    except Exception:  # noqa: BLE001 - the version is informative only
        return None


def _write_tower(out: Path, route: str, encoder: Any, tokenizer: Any, max_length: int) -> list[tuple[str, str]]:
    """Write one tower's sentence-transformers modules; returns ``(folder, module kind)`` in pipeline order."""
    config = encoder.config
    names = ["Transformer", "Pooling"]
    if config.pooling == "pooler":
        names.append("Dense")
    if encoder.projection is not None:
        names.append("Dense")
    if config.normalize:
        names.append("Normalize")
    folders = [f"{route}_{i}_{name}" if route else ("" if i == 0 else f"{i}_{name}") for i, name in enumerate(names)]
    _write_transformer(out / folders[0], encoder.transformer, tokenizer, config, max_length)
    hidden = encoder.transformer.config.hidden_size
    mode = {"mean": "mean", "last": "lasttoken"}.get(config.pooling, "cls")
    (out / folders[1]).mkdir(parents=True, exist_ok=True)
    write_json(out / folders[1] / "config.json",
               {"embedding_dimension": hidden, "pooling_mode": mode, "include_prompt": True})
    dense = [m for m in (encoder.transformer.pooler.dense if config.pooling == "pooler" else None,
                         encoder.projection) if m is not None]
    for folder, linear in zip(folders[2:2 + len(dense)], dense):
        activation = TANH if linear is not encoder.projection else IDENTITY
        _write_dense(out / folder, linear, activation)
    if config.normalize:
        (out / folders[-1]).mkdir(parents=True, exist_ok=True)
        write_json(out / folders[-1] / "config.json", {})
    return list(zip(folders, names))


def _write_transformer(folder: Path, model: nn.Module, tokenizer: Any, config: Any, max_length: int) -> None:
    """The Hugging Face model and tokenizer (``model_max_length`` = this tower's plain-``encode`` length)."""
    check_saveable(model)
    folder.mkdir(parents=True, exist_ok=True)
    with transformers_quiet(), warnings.catch_warnings():  # peft saves an adapted embedding layer, and says so
        warnings.filterwarnings("ignore", message="Setting `save_embedding_layers` to `True`", category=UserWarning)
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    settings_file = folder / "tokenizer_config.json"
    settings = read_json_object(settings_file) if settings_file.is_file() else {}
    settings["model_max_length"] = max_length
    write_json(settings_file, settings)
    write_json(folder / "sentence_bert_config.json", {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
        "query_length": config.query_max_length, "document_length": config.passage_max_length,
        **({"do_lower_case": True} if lowercases(tokenizer) else {})})


def _write_dense(folder: Path, linear: nn.Linear, activation: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", {"in_features": linear.in_features, "out_features": linear.out_features,
                                        "bias": linear.bias is not None, "activation_function": activation,
                                        "module_input_name": "sentence_embedding",
                                        "module_output_name": "sentence_embedding"})
    tensors = {"linear.weight": linear.weight.detach().cpu().contiguous()}
    if linear.bias is not None:
        tensors["linear.bias"] = linear.bias.detach().cpu().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class Tower:
    """One sentence-transformers route: where its transformer is and what follows it."""

    transformer: Path
    pooling: str = "cls"
    dense: list = dataclasses.field(default_factory=list)  # (folder, activation) in order
    normalize: bool = False
    query_length: Optional[int] = None
    document_length: Optional[int] = None
    max_seq_length: Optional[int] = None
    lower_case: bool = False  # sentence_bert_config.json's do_lower_case
    prompt_left_out: Optional[Path] = None  # the Pooling config.json that sets include_prompt false


def read_pipeline(folder: Path) -> Optional[dict[str, Tower]]:
    """The towers a sentence-transformers folder declares: ``{"query": .., "document": ..}`` (the same object
    for a shared tower), or None when ``folder`` has no ``modules.json``."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    entries = check_list(read_json_list(modules_file, "sentence-transformers modules"), modules_file,
                         lambda m, where: check_fields(m, where, MODULE_FIELDS, "a module"), "modules.json")
    modules = [(inside(folder, m.get("path", ""), modules_file, "path"), m.get("type", "")) for m in entries]
    router = [path for path, kind in modules if _kind(kind) in ("Router", "Asym")]
    if not router:
        tower = _read_tower(modules_file, modules)
        return {"query": tower, "document": tower}
    tail = [(path, kind) for path, kind in modules if _kind(kind) not in ("Router", "Asym")]
    config_file = router[0] / "router_config.json"
    if not config_file.is_file() and (router[0] / "config.json").is_file():  # an older Asym/Router folder's
        config_file = router[0] / "config.json"
    config = check_fields(read_json_object(config_file), config_file, ROUTER_FIELDS, "a router config")
    structure, types = config.get("structure") or {}, config.get("types") or {}
    towers = {}
    for route in ROUTES.values():
        if route not in structure:
            raise DprGcError(f"{config_file}: no {route!r} route; dpr-gc reads query/document routers")
        names = structure[route] if isinstance(structure[route], list) else [None]
        route_modules = [(inside(router[0], name, config_file, f"structure.{route}"), str(types.get(name, "")))
                         for name in names]
        towers[route] = _read_tower(config_file, route_modules + tail)
    return towers


def _kind(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def _read_tower(source: Path, modules: list[tuple[Path, str]]) -> Tower:
    if not modules or _kind(modules[0][1]) != "Transformer":
        raise DprGcError(f"{source}: the pipeline must start with a Transformer module to load in dpr-gc")
    tower = Tower(modules[0][0])
    _check_transformer_folder(source, tower.transformer)
    settings_file = tower.transformer / "sentence_bert_config.json"
    if settings_file.is_file():
        settings = check_fields(read_json_object(settings_file), settings_file, TRANSFORMER_FIELDS, "sentence_bert_config.json")
        tower.query_length, tower.document_length = settings.get("query_length"), settings.get("document_length")
        tower.max_seq_length, tower.lower_case = settings.get("max_seq_length"), settings.get("do_lower_case", False)
    for path, kind in modules[1:]:
        if tower.normalize:  # dpr-gc normalises last, as its Encoder does
            raise DprGcError(f"{source}: a {_kind(kind)} module ({path.name or kind}) after Normalize is not supported "
                             "by dpr-gc, which normalises last; use a folder whose Normalize module comes last")
        if _kind(kind) == "Pooling":
            tower.pooling = _pooling_mode(path / "config.json")
            if _includes_prompt(path / "config.json") is False:
                tower.prompt_left_out = path / "config.json"
        elif _kind(kind) == "Dense":
            dense = check_fields(read_json_object(path / "config.json"), path / "config.json", DENSE_FIELDS, "a Dense layer",
                                 required=("out_features",))
            tower.dense.append((path, dense.get("activation_function", TANH)))
        elif _kind(kind) == "Normalize":
            tower.normalize = True
        else:
            raise DprGcError(f"{source}: module {kind} is not supported by dpr-gc "
                             "(Transformer, Pooling, Dense, Normalize and query/document Routers are)")
    return tower


def _check_transformer_folder(source: Path, folder: Path) -> None:
    """Refuse a pipeline whose Transformer module's folder lacks its ``config.json`` (or a LoRA tower's
    ``adapter_config.json``): transformers would blame a missing ``model_type`` key in a file that is not there."""
    if folder.is_dir() and not any((folder / name).is_file() for name in ("config.json", ADAPTER_CONFIG)):
        raise DprGcError(f"{source}: its Transformer module {folder} has no config.json (the model's settings); "
                         "the folder is incomplete: copy the model's config.json back or save the model again")


def _includes_prompt(config_file: Path) -> Optional[bool]:
    """A Pooling config's ``include_prompt`` (None when not stated: sentence-transformers then includes it)."""
    return read_json_object(config_file).get("include_prompt") if config_file.is_file() else None


def check_prompts_pooled(towers: dict[str, Tower], config: RetrieverConfig) -> None:
    """Refuse a folder that pools without its prompt's tokens (``include_prompt: false``) when it has a prompt:
    dpr-gc pools every token, the prefix's too, so its embeddings would differ from sentence-transformers'."""
    for kind, prefix in (("query", config.query_prefix), ("document", config.passage_prefix)):
        left_out = towers[kind].prompt_left_out
        if prefix and left_out is not None:
            raise DprGcError(f"{left_out}: include_prompt false (pooling without the {kind} prompt {prefix[:40]!r}) "
                             "is not supported by dpr-gc, which pools the prompt's tokens too; set include_prompt "
                             "to true there (the embeddings change) or remove the folder's prompts")


def _pooling_mode(config_file: Path) -> str:
    config = check_fields(read_json_object(config_file), config_file, POOLING_FIELDS, "a Pooling layer") \
        if config_file.is_file() else {}
    mode = config.get("pooling_mode")
    if mode is None:
        legacy = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
        active = [name for key, name in legacy.items() if config.get(key)]
        others = [key for key, on in config.items() if key.startswith("pooling_mode_") and on and key not in legacy]
        mode = "unsupported" if others or len(active) > 1 else (active[0] if active else "mean")
    mode = "last" if mode == "lasttoken" else mode
    if mode not in ("cls", "mean", "last"):
        raise DprGcError(f"{config_file}: pooling {mode!r} is not supported by dpr-gc (cls, mean or lasttoken)")
    return mode


def config_from_pipeline(folder: Path, towers: dict[str, Tower]) -> RetrieverConfig:
    """The recipe a foreign sentence-transformers folder declares: pooling, normalisation, projection, its
    "query"/"document" prompts as prefixes, passages as ``title + " " + text``, and max lengths: each route's
    query/document length, else where sentence-transformers cuts that route's texts (:func:`text_limit`), queries at
    most 64 tokens."""
    query, document = towers["query"], towers["document"]
    for tower in (query, document):
        if any(activation != IDENTITY for _, activation in tower.dense) or len(tower.dense) > 1:
            raise DprGcError(f"{folder}: only one linear (identity) Dense layer per tower is supported by dpr-gc")
    if (query.pooling, query.normalize) != (document.pooling, document.normalize):
        raise DprGcError(f"{folder}: the query and document routes pool differently; dpr-gc needs one recipe")
    dims = {read_json_object(path / "config.json")["out_features"] for t in (query, document) for path, _ in t.dense}
    if len(dims) > 1 or (dims and len(query.dense) != len(document.dense)):
        raise DprGcError(f"{folder}: the query and document routes have different output sizes")
    settings_file = folder / "config_sentence_transformers.json"
    prompts = (check_fields(read_json_object(settings_file), settings_file, ST_FIELDS, "sentence-transformers settings")
               .get("prompts") or {}) if settings_file.is_file() else {}
    for key, value in prompts.items():
        if not isinstance(value, str) or not no_lone_surrogates(value):
            raise DprGcError(f"{settings_file}: prompt {key!r} must be a string, got {type(value).__name__}")
    passage_length = document.document_length or text_limit(document) or DEFAULT_LENGTH
    query_length = query.query_length or min(QUERY_LENGTH, text_limit(query) or DEFAULT_LENGTH)
    config = RetrieverConfig(pooling=query.pooling, normalize=query.normalize,
                             projection_dim=dims.pop() if dims else None, shared_encoder=query is document,
                             passage_format="concat", query_max_length=query_length,
                             passage_max_length=passage_length, query_prefix=prompts.get("query", ""),
                             passage_prefix=next((prompts[k] for k in DOCUMENT_PROMPTS if k in prompts), ""))
    check_prompts_pooled(towers, config)
    return config


def text_limit(tower: Tower) -> Optional[int]:
    """The tokens sentence-transformers cuts this tower's texts at when it sets no query/document length: its
    ``max_seq_length``, else the least of the tokenizer's ``model_max_length`` and the model's
    ``max_position_embeddings``; None when none of them is stated."""
    if tower.max_seq_length:
        return tower.max_seq_length
    limits = [_stated_int(tower.transformer / "tokenizer_config.json", "model_max_length"),
              _stated_int(tower.transformer / "config.json", "max_position_embeddings")]
    limits = [n for n in limits if n is not None]
    return min(limits) if limits else None


def _stated_int(path: Path, key: str) -> Optional[int]:
    """``key`` of the JSON object in ``path`` when it is a positive int short of "no limit" (transformers: 1e30)."""
    value = read_json_object(path).get(key) if path.is_file() else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < NO_LIMIT else None


def load_pipeline_retriever(retriever_cls: Any, folder: Path, towers: dict[str, Tower], config: Any) -> Any:
    """Build a retriever from the towers of a sentence-transformers folder (format 2 or foreign) under ``config``."""
    query, document = towers["query"], towers["document"]
    q_model = load_transformer(query.transformer)
    p_model = None if query is document else load_transformer(document.transformer)
    tokenizer = load_tokenizer(query.transformer, q_model) if p_model is None else \
        one_tokenizer(query.transformer, q_model, document.transformer, p_model)
    lower_case(tokenizer, towers, folder)
    retriever = retriever_cls(q_model, p_model, tokenizer, config)
    for tower, encoder in ((query, retriever.query_encoder), (document, retriever.passage_encoder)):
        projection = [path for path, activation in tower.dense if activation == IDENTITY]
        if encoder.projection is not None:
            if len(projection) != 1:
                raise DprGcError(f"{folder}: projection_dim is set but the tower has no projection Dense layer")
            encoder.projection = _dense_linear(projection[0], encoder.projection)
            _load_linear(projection[0], encoder.projection)
    load_heads(folder, retriever, projections=False)
    return retriever.check_widths(folder)


def lower_case(tokenizer: Any, towers: dict[str, Tower], folder: Path) -> None:
    """Make ``tokenizer`` lower-case every text (prompt included) when the folder's ``sentence_bert_config.json``
    says ``do_lower_case``, as sentence-transformers does: a ``Lowercase`` normalizer put first in the fast
    tokenizer's, unless it has one. A save keeps it in ``tokenizer.json``, so the saved folder lower-cases in
    dpr-gc, sentence-transformers and transformers alike."""
    wanted = {towers["query"].lower_case, towers["document"].lower_case}
    if wanted == {False}:
        return
    if len(wanted) > 1:
        raise DprGcError(f"{folder}: one route sets do_lower_case in its sentence_bert_config.json and the other does "
                         "not; dpr-gc has one tokenizer for both, so set do_lower_case alike in both")
    if not getattr(tokenizer, "is_fast", False):
        raise DprGcError(f"{folder}: do_lower_case in sentence_bert_config.json needs a fast tokenizer "
                         "(tokenizer.json); save the tokenizer with tokenizer.json or lower-case it there")
    from tokenizers.normalizers import Lowercase, Sequence

    if not lowercases(tokenizer):
        tokenizer.backend_tokenizer.normalizer = Sequence([Lowercase(), *normalizers(tokenizer)])


def _dense_linear(folder: Path, linear: nn.Linear) -> nn.Linear:
    """``linear``, or one of its shape without a bias where the Dense layer in ``folder`` has ``"bias": false``
    (sentence-transformers' Dense may have none; a retriever builds its projections with one). Saved again, the
    folder keeps its layer bias-less (:func:`_write_dense`)."""
    if read_json_object(folder / "config.json").get("bias", True):
        return linear
    return nn.Linear(linear.in_features, linear.out_features, bias=False)


def _load_linear(folder: Path, linear: nn.Linear) -> None:
    weights = folder / "model.safetensors"
    if not weights.is_file() and (folder / "pytorch_model.bin").is_file():
        weights = folder / "pytorch_model.bin"  # written by sentence-transformers with safe_serialization=False
    if not weights.is_file():
        raise DprGcError(f"{folder}: no model.safetensors for this Dense layer")
    state = read_tensors(weights)
    try:
        linear.load_state_dict({"weight": state["linear.weight"], **({"bias": state["linear.bias"]}
                                                                     if linear.bias is not None else {})})
    except (KeyError, RuntimeError) as e:
        raise DprGcError(f"{weights}: not the projection this retriever expects ({str(e).splitlines()[0]})") from None


def load_format1(retriever_cls: Any, folder: Path, config: Any) -> Any:
    """Folders written before format 2: ``query_encoder/``, ``passage_encoder/``, ``tokenizer/``, ``projection.pt``."""
    q_model = load_transformer(folder / "query_encoder")
    p_model = None if config.shared_encoder else load_transformer(folder / "passage_encoder")
    retriever = retriever_cls(q_model, p_model, load_tokenizer(folder / "tokenizer", q_model), config)
    load_heads(folder, retriever, projections=True)
    return retriever.check_widths(folder)


def load_heads(folder: Path, retriever: Any, projections: bool) -> None:
    """The raw temperature parameter (and, in format 1, the projections) from ``heads.safetensors``, or from a
    format-1 ``projection.pt`` (plain tensors only; such folders keep only the clamped temperature, in JSON)."""
    path = folder / HEADS_NAME
    if not path.is_file():
        path = folder / "projection.pt"
        if not (projections and path.is_file()):
            return
    heads = read_tensors(path)
    try:
        if projections:
            for name, enc in (("query", retriever.query_encoder), ("passage", retriever.passage_encoder)):
                if enc.projection is not None:
                    enc.projection.weight.data.copy_(heads[f"{name}_projection.weight"])
                    enc.projection.bias.data.copy_(heads[f"{name}_projection.bias"])
        if TEMPERATURE_KEY in heads:
            retriever.tau.log_value.data.copy_(heads[TEMPERATURE_KEY])
    except (KeyError, RuntimeError) as e:
        raise DprGcError(f"{path}: does not fit {CONFIG_NAME} ({str(e).splitlines()[0]}); save it again") from None


def load_retriever(retriever_cls: Any, folder: Path) -> Any:
    """A ``retriever_cls`` (the class whose ``load`` calls this) from what ``folder`` holds: a saved retriever
    (format 2 or 1), an official DPR pair, a sentence-transformers folder, or else a Hugging Face model name or
    folder (with the defaults of :class:`RetrieverConfig`, a decoder-only model's last-token pooling and concat
    passages)."""
    if (folder / CONFIG_NAME).is_file():
        data = check_fields(read_json_object(folder / CONFIG_NAME), folder / CONFIG_NAME, RETRIEVER_FIELDS, CONFIG_NAME)
        version = data.get("format_version", 1)
        if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise DprGcError(f"{folder / CONFIG_NAME}: format_version {version!r} is not one this dpr-gc reads "
                             f"(1 to {FORMAT_VERSION}); upgrade dpr-gc")
        config = RetrieverConfig.from_dict(data)
        if version == 1:
            return load_format1(retriever_cls, folder, config)
        towers = read_pipeline(folder)
        if towers is None:
            raise DprGcError(f"{folder}: {CONFIG_NAME} says format {version} but modules.json is missing")
        return load_pipeline_retriever(retriever_cls, folder, towers, config)
    pair = find_dpr_pair(folder)
    if pair is not None:
        return load_dpr(retriever_cls, *pair)
    towers = read_pipeline(folder) if folder.is_dir() else None
    if towers is not None:
        return load_pipeline_retriever(retriever_cls, folder, towers, config_from_pipeline(folder, towers))
    return retriever_cls.from_pretrained(str(folder), RetrieverConfig(), chosen=())
