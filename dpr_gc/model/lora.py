"""LoRA adapters on the query/passage towers, through Hugging Face ``peft``.

Only the adapter matrices of a tower's transformer train (a projection head and a learnable temperature, which are
not part of the pretrained model, train as before). A saved retriever keeps each adapted tower in PEFT's own format
(``adapter_config.json`` + ``adapter_model.safetensors``, the base model named by its absolute path), which
:func:`load_adapter_model` reads back; ``dpr-gc merge-lora`` writes a retriever with the adapters merged into full
weights, for export to tools without ``peft``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from ..base.args import output_dir, positive_float, positive_int
from ..base.errors import DprGcError
from ..base.guard import guarded
from ..base.files import read_json
from ..base.validate import check_weights_folder

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ENCODER_TARGETS = ("query", "key", "value", "dense")
DECODER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linear layers adapted by default, by transformers ``model_type``: attention and feed-forward of every block.
DEFAULT_TARGETS = {**dict.fromkeys(("bert", "roberta", "xlm-roberta", "camembert", "electra"), ENCODER_TARGETS),
                   **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"),
                                   DECODER_TARGETS)}


@dataclasses.dataclass
class LoraSettings:
    """``--lora-r`` (the rank; LoRA is on when given), ``--lora-alpha`` (default ``2 r``), ``--lora-dropout`` and
    ``--lora-target-modules`` (default: :data:`DEFAULT_TARGETS` for the model's type)."""

    r: int
    alpha: Optional[float] = None
    dropout: float = 0.0
    target_modules: Optional[Sequence[str]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 1:
            raise DprGcError(f"--lora-r must be a positive integer, got {self.r!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise DprGcError(f"--lora-alpha must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise DprGcError(f"--lora-dropout must lie in [0, 1), got {self.dropout}")
        if self.target_modules is not None and not list(self.target_modules):
            raise DprGcError("--lora-target-modules needs at least one module name")


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise DprGcError("LoRA needs the package peft (pip install -r requirements.txt)") from None
    return peft


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT-wrapped transformer."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def default_targets(model: nn.Module) -> list[str]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_TARGETS:
        raise DprGcError(f"no default LoRA target modules for model type {model_type!r}; name the Linear layers "
                         "to adapt with --lora-target-modules (e.g. q_proj,v_proj)")
    return list(DEFAULT_TARGETS[model_type])


def _towers(retriever: Any) -> list[Any]:
    """The distinct encoders of a retriever (one when the tower is shared)."""
    return list({id(e): e for e in (retriever.query_encoder, retriever.passage_encoder)}.values())


def apply_lora(retriever: Any, settings: LoraSettings) -> int:
    """Put LoRA adapters on every tower's transformer and freeze its other weights; a tower already carrying an
    adapter (a saved LoRA retriever) has that adapter made trainable instead. Returns the trainable adapter size."""
    peft = _peft()
    for encoder in _towers(retriever):
        model = encoder.transformer
        if not is_adapted(model):
            targets = list(settings.target_modules or default_targets(model))
            config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha or 2 * settings.r,
                                     lora_dropout=settings.dropout, target_modules=targets, bias="none")
            base = str(getattr(model.config, "name_or_path", "") or "")
            try:
                model = peft.get_peft_model(model, config)
            except ValueError as e:
                raise DprGcError(f"--lora-target-modules {','.join(targets)}: {str(e).splitlines()[0]}") from None
            if base and Path(base).exists():  # the adapter names its base; absolute, so the folder can move
                model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
            encoder.transformer = model
        for name, param in model.named_parameters():
            # an unused pooler (any pooling but "pooler") gets no gradient, so its adapter stays frozen too
            param.requires_grad_("lora_" in name and (encoder.config.pooling == "pooler" or ".pooler." not in name))
    size = sum(p.numel() for e in _towers(retriever) for p in e.transformer.parameters() if p.requires_grad)
    logger.info("LoRA: %d trainable adapter parameters", size)
    return size


def check_saveable(model: nn.Module) -> None:
    """Refuse to save an adapter whose base model has no folder or name to be loaded from again."""
    if is_adapted(model) and not model.peft_config["default"].base_model_name_or_path:
        raise DprGcError("cannot save a LoRA adapter whose base model has no folder or name: save the base model "
                         "first and start from that folder")


def load_adapter_model(folder: Path, trainable: bool = False) -> nn.Module:
    """A PEFT adapter folder on top of the base model its ``adapter_config.json`` names."""
    from .retriever import load_transformer

    config = read_json(folder / ADAPTER_CONFIG)
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise DprGcError(f"{folder / ADAPTER_CONFIG}: no base_model_name_or_path; cannot tell which model the "
                         "adapter belongs to")
    if not isinstance(base, str) or (Path(base) / ADAPTER_CONFIG).is_file():
        raise DprGcError(f"{folder / ADAPTER_CONFIG}: base_model_name_or_path {str(base)[:200]!r} must name a plain "
                         "model (not an adapter folder, not this folder); point it at the base model")
    check_weights_folder(folder)
    peft = _peft()
    try:
        return peft.PeftModel.from_pretrained(load_transformer(base), str(folder), is_trainable=trainable)
    except pickle.UnpicklingError:
        raise DprGcError(f"{folder}: the adapter weights are a pickle, which dpr-gc never loads; save the adapter as "
                         "adapter_model.safetensors") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise DprGcError(f"cannot load the LoRA adapter in {folder}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None


def merge_lora(retriever: Any) -> int:
    """Merge every tower's adapter into its weights (in place); returns how many towers were merged."""
    merged = 0
    for encoder in _towers(retriever):
        if is_adapted(encoder.transformer):
            encoder.transformer = encoder.transformer.merge_and_unload()
            merged += 1
    return merged


def add_lora_arguments(parser: Any) -> None:
    """The training flags that turn LoRA on and shape it."""
    parser.add_argument("--lora-r", type=positive_int, default=None, help="LoRA rank: train low-rank adapters only")
    parser.add_argument("--lora-alpha", type=positive_float, default=None,
                        help="LoRA scaling numerator (default 2 * rank)")
    parser.add_argument("--lora-dropout", type=dropout_rate, default=0.0, help="dropout on the LoRA input, in [0, 1)")
    parser.add_argument("--lora-target-modules", default=None,
                        help="comma-separated Linear module names to adapt (default: per architecture, e.g. "
                             "query,key,value,dense for BERT, q_proj,...,down_proj for Llama/Qwen2)")


def dropout_rate(text: str) -> float:
    """A flag value in [0, 1) (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def lora_settings(args: argparse.Namespace) -> Optional[LoraSettings]:
    """The :class:`LoraSettings` the flags ask for, or None without ``--lora-r``."""
    if args.lora_r is None:
        return None
    targets = [t.strip() for t in args.lora_target_modules.split(",") if t.strip()] if args.lora_target_modules else None
    return LoraSettings(args.lora_r, args.lora_alpha, args.lora_dropout, targets)


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("merge-lora", help="write a retriever with its LoRA adapters merged into full weights")
    p.add_argument("--model", required=True, help="a saved retriever whose towers carry LoRA adapters")
    p.add_argument("--output", type=output_dir, required=True, help="folder for the merged retriever")
    p.set_defaults(func=_cli)


@guarded(inputs=("model",), outputs={"output": "whole"})
def _cli(args: argparse.Namespace) -> None:
    from .retriever import Retriever

    retriever = Retriever.load(args.model)
    if not merge_lora(retriever):
        raise DprGcError(f"{args.model}: no LoRA adapter to merge (a retriever trained with --lora-r has one)")
    retriever.save(args.output)
    logger.info("wrote the merged retriever to %s", args.output)
