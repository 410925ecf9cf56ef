"""What a training run starts from: its sources checked before anything is built, and the retriever it trains."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from ..base.errors import DprGcError
from ..base.logs import infos_hidden
from ..base.settings import to_record
from ..engine.loss import Temperature
from ..model.dpr_hub import find_dpr_pair
from ..model.folder import CONFIG_NAME, config_from_pipeline, load_pipeline_retriever, lower_case, read_pipeline
from ..model.config import DECODER_RECIPE, is_causal_decoder
from ..model.lora import LoraSettings, lora_defaults
from ..model.pretrained import default_model_path, read_model_config
from ..model.retriever import Retriever, RetrieverConfig, check_max_length, decoder_recipe
from ..model.tokenize import check_length_room
from .config import DataConfig, ModelConfig

logger = logging.getLogger(__name__)


def check_sources(data: DataConfig, output: str) -> None:
    """Refuse a missing training or dev source (naming its flag), or no output folder, before anything is built."""
    if not data.train_files or not output:
        raise DprGcError("training needs training data (--train) and an output folder (--output)")
    sources = [("--train", s) for s in data.train_files] + ([("--dev", data.dev_file)] if data.dev_file else [])
    for flag, source in sources:
        if not Path(source).exists():
            raise DprGcError(f"{flag} data not found: {source} (give DPR files or BEIR folders)")


def build_retriever(model: ModelConfig, beside: Sequence[tuple[str, Any, bool]] = (), quiet: bool = False) -> Retriever:
    """A saved retriever folder, an official DPR pair or a DPR ``.cp`` file loads as it is (prefixes given as flags
    replace its own); a sentence-transformers folder starts from its own recipe (:func:`folder_recipe`, whose log
    line also lists ``beside``); any other model name or folder starts a new one from ``model.retriever``.
    ``quiet``: the same retriever built again, its choices (the toolkit's INFO lines) not logged a second time."""
    with infos_hidden(logging.getLogger("dpr_gc")) if quiet else contextlib.nullcontext():
        return _build_retriever(model, beside)


def _build_retriever(model: ModelConfig, beside: Sequence[tuple[str, Any, bool]]) -> Retriever:
    name = model.path()
    if (Path(name) / CONFIG_NAME).is_file() or Path(name).is_file() or find_dpr_pair(Path(name)):
        retriever = Retriever.load(name, query_prefix=model.query_prefix, passage_prefix=model.passage_prefix)
        if chosen_fields(model) - {"query_prefix", "passage_prefix"}:
            logger.info("%s is a saved retriever: its own pooling/temperature/lengths are used", name)
        fit_and_say_lengths(retriever, name)  # a stored length beyond the model's positions: cut
        return retriever.check_room("query", "passage")
    prefixes = {k: v for k, v in (("query_prefix", model.query_prefix), ("passage_prefix", model.passage_prefix))
                if v is not None}
    towers = read_pipeline(Path(name)) if Path(name).is_dir() else None
    if towers is None:
        config = dataclasses.replace(model.retriever or RetrieverConfig(), **prefixes)
        return check_lengths(Retriever.from_pretrained(name, config, chosen_fields(model)), model)
    config = dataclasses.replace(folder_recipe(name, towers, model, beside), **prefixes)
    folder = config_from_pipeline(Path(name), towers)
    if config.projection_dim != folder.projection_dim:  # a projection asked for anew starts from random weights
        retriever = Retriever.from_pretrained(str(towers["query"].transformer), config)
        lower_case(retriever.tokenizer, towers, Path(name))
        return check_lengths(retriever, model)
    retriever = load_pipeline_retriever(Retriever, Path(name), towers,
                                        dataclasses.replace(config, shared_encoder=folder.shared_encoder))
    if config.shared_encoder != folder.shared_encoder:
        retriever = retower(retriever, config)
    retriever.training_info["base_model"] = name
    return check_lengths(retriever, model)


def retower(loaded: Retriever, config: RetrieverConfig) -> Retriever:
    """``loaded`` (a folder's towers, weights and projection as read) with ``config``'s towers: one shared tower, or
    two, each its query tower's copy, projection included, so ``--separate-encoders`` / ``--shared-encoder`` start
    from the folder's weights and embed as it does before the first step."""
    query = loaded.query_encoder
    passage = None if config.shared_encoder else copy.deepcopy(query.transformer)
    retriever = Retriever(query.transformer, passage, loaded.tokenizer, config)
    if query.projection is not None:
        for encoder in (retriever.query_encoder, retriever.passage_encoder):
            encoder.projection.load_state_dict(query.projection.state_dict())
    retriever.tau.load_state_dict(loaded.tau.state_dict())
    return retriever


LENGTHS = {"query_max_length": "query", "passage_max_length": "passage"}


def chosen_fields(model: ModelConfig) -> set[str]:
    """The :class:`RetrieverConfig` fields the user chose: the flags given, or (a library caller, who names no flags)
    those of ``model.retriever`` that differ from the defaults."""
    if model.retriever_flags is not None:
        return set(model.retriever_flags)
    if model.retriever is None:
        return set()
    defaults = RetrieverConfig()
    return {f.name for f in dataclasses.fields(RetrieverConfig)
            if getattr(model.retriever, f.name) != getattr(defaults, f.name)}


def fit_and_say_lengths(retriever: Retriever, name: str) -> None:
    """Cut the max lengths of ``retriever`` (from ``name``) beyond its model's positions to them, as training and the
    retriever it saves use them (:meth:`Retriever.fit_lengths`), saying so in one line."""
    cut = retriever.fit_lengths()
    if cut:
        logger.info("%s takes %s positions: %s, the length texts are cut to and the retriever records",
                    name, retriever.positions("passage"), "; ".join(cut))


def check_lengths(retriever: Retriever, model: ModelConfig) -> Retriever:
    """``retriever``, refused when a max length the user chose exceeds the positions its model takes (as encode
    refuses such a ``--max-length``), before anything is written: the retriever would save it and every later
    command fail on a longer text. A length not chosen (the default, a folder's own) is cut where texts are
    tokenised instead (:meth:`Retriever.max_length`), as a default is no mistake of the user's, logged once and
    recorded as cut (:meth:`Retriever.fit_lengths`); the room it leaves a text beside a prefix is checked all the same
    (:meth:`Retriever.check_room`)."""
    flags = {f.name: f.metadata["setting"].flag for f in dataclasses.fields(RetrieverConfig)}
    chosen = chosen_fields(model) & set(LENGTHS)
    for name in sorted(chosen):
        length = getattr(retriever.config, name)
        check_max_length(flags[name], length, retriever.positions(LENGTHS[name]))
        check_length_room(retriever.tokenizer, retriever.config, LENGTHS[name], length, flags[name])
    fit_and_say_lengths(retriever, model.path())
    return retriever.check_room(*(LENGTHS[name] for name in sorted(set(LENGTHS) - chosen)))


RECIPE = ("pooling", "normalize", "projection_dim", "shared_encoder", "passage_format", "query_max_length",
          "passage_max_length", "query_prefix", "passage_prefix", "temperature")
ST_TEMPERATURE = 0.05  # sentence-transformers' MultipleNegativesRankingLoss: cosine similarity at scale 20


def folder_recipe(name: str, towers: dict, model: ModelConfig,
                  beside: Sequence[tuple[str, Any, bool]] = ()) -> RetrieverConfig:
    """The settings a sentence-transformers folder declares (pooling, normalisation, projection, passage format,
    max lengths, its "query"/"document" prompts as prefixes) as the defaults of training it, each field the user
    set (:func:`chosen_fields`: the flags given, or those of ``model.retriever`` a library caller changed from the
    defaults, as for a plain model) replacing the folder's; the temperature, which no folder records, defaults to
    sentence-transformers' 0.05 for a normalised model (cosine similarity at MultipleNegativesRankingLoss's scale 20)
    and 1.0 otherwise. Logs what it took and what was given,
    with ``beside``: the training's own settings of the recipe, as ``(name, value, given)`` (the hard negatives:
    MultipleNegativesRankingLoss has none)."""
    folder = config_from_pipeline(Path(name), towers)
    given = model.retriever or RetrieverConfig()
    flags = chosen_fields(model)
    chosen = {f.name: getattr(given if f.name in flags else folder, f.name) for f in dataclasses.fields(RetrieverConfig)}
    for prefix in ("query_prefix", "passage_prefix"):  # prefix flags live in ModelConfig
        if getattr(model, prefix) is not None:
            flags.add(prefix)
            chosen[prefix] = getattr(model, prefix)
    if "temperature" not in flags:
        chosen["temperature"] = ST_TEMPERATURE if chosen["normalize"] else 1.0
    config = RetrieverConfig(**chosen)
    taken = [f"{k}={chosen[k]!r}" for k in RECIPE if k not in flags]
    taken += [f"{k}={value!r}" for k, value, given in beside if not given]
    given = [f"{k}={chosen[k]!r}" for k in RECIPE if k in flags] + [f"{k}={v!r}" for k, v, g in beside if g]
    if taken:
        logger.info("%s is a sentence-transformers folder; its recipe: %s%s", name, ", ".join(taken),
                    f" (given: {', '.join(given)})" if given else "")
    return config


def resolve_recipe(model: ModelConfig, warn: bool = False) -> ModelConfig:
    """``model`` with ``retriever`` holding the recipe a sentence-transformers folder trains with
    (:func:`folder_recipe`: the flags given, the folder's own values for the rest), a saved retriever folder's own
    (:func:`saved_recipe`), or a plain decoder-only model's (:func:`plain_recipe`), so the run records, and
    ``--resume`` compares, the pooling, normalisation and temperature it used, not the library's defaults. The
    prefix flags stay in their own fields (the folder's prompts are the recipe's). Any other model as it is: a new
    one starts from ``retriever`` itself."""
    name = model.path()
    towers = None if (Path(name) / CONFIG_NAME).is_file() or not Path(name).is_dir() else read_pipeline(Path(name))
    if towers is not None:
        with infos_hidden(logger):  # build_retriever says the recipe
            recipe = folder_recipe(name, towers, dataclasses.replace(model, query_prefix=None, passage_prefix=None))
    elif (Path(name) / CONFIG_NAME).is_file():
        recipe = saved_recipe(model, warn)
    else:
        return plain_recipe(model)
    if recipe is None:
        return model
    return dataclasses.replace(model, retriever=recipe, retriever_flags=tuple(sorted(chosen_fields(model))))


def plain_recipe(model: ModelConfig) -> ModelConfig:
    """``model`` with a plain decoder-only model's recipe (:func:`~dpr_gc.model.retriever.decoder_recipe`: last-token
    pooling and concat passages where not given) read from its config before it loads; any other model (an encoder,
    a DPR file or pair, one whose config cannot be read here) as it is."""
    if Path(model.path()).is_file() or find_dpr_pair(Path(model.path())):
        return model
    model_config = read_model_config(model.path())
    chosen = chosen_fields(model)
    if model_config is None or not is_causal_decoder(model_config):
        return model
    recipe = decoder_recipe(model_config, model.retriever or RetrieverConfig(), chosen)
    return dataclasses.replace(model, retriever=recipe, retriever_flags=tuple(sorted(chosen)))


def saved_recipe(model: ModelConfig, warn: bool) -> Optional[RetrieverConfig]:
    """The recipe ``model``'s saved retriever folder keeps (it loads as it is); with ``warn``, the recipe flags given
    with other values are named in a warning, since they are not used. None for an unreadable config, left to the
    load to report."""
    try:
        saved = RetrieverConfig.from_dict(json.loads((Path(model.path()) / CONFIG_NAME).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    given = [f for f in model.retriever_flags or () if f not in ("query_prefix", "passage_prefix")]
    unused = [f for f in given if model.retriever is not None and not same_value(getattr(model.retriever, f),
                                                                                getattr(saved, f))]
    if warn and unused:
        logger.warning("%s is a saved retriever and keeps its own recipe: %s not used (it has %s)", model.path(),
                       ", ".join(f"--{f.replace('_', '-')} {getattr(model.retriever, f)!r}" for f in unused),
                       ", ".join(f"{f} {getattr(saved, f)!r}" for f in unused))
    return saved


def same_value(given: Any, saved: Any) -> bool:
    """Equal, floats to float32's precision (a saved temperature went through a float32 parameter: 0.05 is stored
    as 0.04999999701976776)."""
    if isinstance(given, float) and isinstance(saved, float):
        return math.isclose(given, saved, rel_tol=1e-6)
    return given == saved


def resolve_recorded_recipe(recorded: dict, checkpoint: Optional[Path] = None) -> dict:
    """The settings ``recorded`` by a run, its recipe resolved as :func:`resolve_recipe` resolves a new run's. A
    record from before runs recorded their recipe holds ``model.retriever_flags`` and, for a sentence-transformers
    folder, the library's defaults for the fields not given: those are the folder's values that run trained with.
    A record from before a plain decoder's recipe and LoRA defaults were recorded is read as the run it was
    (:func:`resolve_recorded_decoder`). A newer record is returned as it is."""
    section = recorded.get("model")
    if not isinstance(section, dict):
        return recorded
    if "retriever_flags" not in section:
        return {**recorded, "model": resolve_recorded_decoder(section, checkpoint)}
    old, flags = section.get("retriever"), section.get("retriever_flags")
    model = ModelConfig(name=section.get("name"),
                        retriever=RetrieverConfig.from_dict(old) if isinstance(old, dict) else None,
                        retriever_flags=tuple(flags) if isinstance(flags, list) else None)
    resolved = resolve_recipe(model).retriever
    retriever = to_record(resolved) if resolved is not None else old
    return {**recorded, "model": {**section, "retriever": retriever}}


def resolve_recorded_decoder(section: dict, checkpoint: Optional[Path]) -> dict:
    """A recorded ``model`` section of a plain decoder-only model as the run trained it. Earlier versions recorded
    the library's defaults (pooling cls, passage format pair; LoRA alpha and targets null) where the run took the
    decoder's (:func:`~dpr_gc.model.retriever.decoder_recipe`, :func:`~dpr_gc.model.lora.lora_defaults`): the
    pooling and passage format are those of the retriever ``checkpoint`` saved, else (an FSDP checkpoint saves
    none) the decoder's in place of a recorded cls pooling, which no decoder trains with; a null alpha or target
    list is the default the run took."""
    name = section.get("name") or default_model_path()
    folder = any((Path(name) / f).is_file() for f in (CONFIG_NAME, "modules.json"))  # a saved or s-t folder
    model_config = None if folder else read_model_config(name)
    if model_config is None or not is_causal_decoder(model_config):
        return section
    retriever = section.get("retriever") if isinstance(section.get("retriever"), dict) else to_record(RetrieverConfig())
    saved = saved_fields(checkpoint / "model" / CONFIG_NAME) if checkpoint is not None else None
    if saved is not None:
        retriever = {**retriever, **{k: saved[k] for k in DECODER_RECIPE if isinstance(saved.get(k), str)}}
    elif retriever.get("pooling") == RetrieverConfig().pooling:
        defaults = to_record(RetrieverConfig())
        retriever = {**retriever, **{k: v for k, v in DECODER_RECIPE.items() if retriever.get(k) == defaults[k]}}
    lora = section.get("lora")
    if isinstance(lora, dict):
        try:
            filled = lora_defaults(name, LoraSettings(r=lora.get("r")))
        except DprGcError:  # no rank a run takes: compared as recorded
            return {**section, "retriever": retriever}
        lora = {**lora, **{k: getattr(filled, k) for k in ("alpha", "target_modules") if lora.get(k) is None}}
        return {**section, "retriever": retriever, "lora": lora}
    return {**section, "retriever": retriever}


def saved_fields(path: Path) -> Optional[dict]:
    """The fields of a saved retriever's ``retriever_config.json``; None when it is missing or unreadable."""
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def weight_decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups over ``module``'s trainable parameters: biases, the weights of every normalisation
    layer (BERT's ``LayerNorm``, Llama's and Qwen2's ``RMSNorm``, torch's norms: found by their class's name, since
    each model names the layers its own way) and the temperature are not decayed; the rest are, by
    ``weight_decay``."""
    undecayed = set()
    for prefix, child in module.named_modules():
        all_plain = isinstance(child, Temperature) or "norm" in type(child).__name__.lower()
        for name, _ in child.named_parameters(recurse=False):
            if all_plain or name == "bias":
                undecayed.add(f"{prefix}.{name}" if prefix else name)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n not in undecayed], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n in undecayed], "weight_decay": 0.0}]
