"""LoRA adapters on the query/passage towers, through Hugging Face ``peft``.

Only the adapter matrices of a tower's transformer train (a projection head and a learnable temperature, which are
not part of the pretrained model, train as before). A saved retriever keeps each adapted tower in PEFT's own format
(``adapter_config.json`` + ``adapter_model.safetensors``, the base model named by its absolute path), which
:func:`~dpr_gc.model.pretrained.load_adapter_model` reads back; ``dpr-gc merge-lora`` writes a retriever with the adapters merged into full
weights, for export to tools without ``peft``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from ..base.args import home_expanded, layer_size, output_dir, positive_float
from ..base.errors import DprGcError
from ..base.files import read_json_object
from ..base.logs import transformers_quiet
from .pretrained import ADAPTER_CONFIG, is_adapted, peft_module, read_model_config
from .folder import check_replaceable, read_pipeline
from .retriever import Retriever
from ..base.settings import add_arguments, check, setting
from ..base.guard import guarded

logger = logging.getLogger(__name__)

ENCODER_TARGETS = ("query", "key", "value", "dense")
SHOWN_NAMES = 8  # of a model's Linear layer names, in a message on LoRA targets
DECODER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linear layers adapted by default, by transformers ``model_type``: attention and feed-forward of every block. A type
# not listed whose blocks hold every one of DECODER_TARGETS (Llama-style names) takes those.
DEFAULT_TARGETS = {**dict.fromkeys(("bert", "roberta", "xlm-roberta", "camembert", "electra"), ENCODER_TARGETS),
                   **dict.fromkeys(("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                                    "granite", "olmo", "olmo2", "olmo3", "cohere", "cohere2", "helium", "smollm3"),
                                   DECODER_TARGETS)}


def dropout_rate(text: str) -> float:
    """A flag value in [0, 1) (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def module_names(text: str) -> list[str]:
    """A comma-separated list of module names (argparse type); empty names are dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]


module_names.words = True  # type: ignore[attr-defined]  # in code: a list of str (settings.check)


@dataclasses.dataclass
class LoraSettings:
    """``--lora-r`` (the rank; LoRA is on when given), ``--lora-alpha`` (default ``2 r``), ``--lora-dropout`` (None:
    0) and ``--lora-target-modules`` (default: :func:`default_targets`); None is a flag not given, so a saved
    adapter's own value applies (:func:`resolve_lora`)."""

    r: int = setting(dataclasses.MISSING, "--lora-r", type=layer_size, cli_default=None,
                     help="LoRA rank, at most 65536: train low-rank adapters only (default: not set, full "
                          "fine-tuning)")
    alpha: Optional[float] = setting(None, "--lora-alpha", type=positive_float,
                                     help="LoRA scaling numerator (default: 2 * rank)")
    dropout: Optional[float] = setting(None, "--lora-dropout", type=dropout_rate,
                                       help="dropout on the LoRA input, in [0, 1) (default: 0, a saved adapter's own)")
    target_modules: Optional[Sequence[str]] = setting(
        None, "--lora-target-modules", type=module_names,
        help="comma-separated Linear module names to adapt (default: per architecture, e.g. query,key,value,dense "
             "for BERT, q_proj,...,down_proj for Llama/Qwen2)")

    def __post_init__(self) -> None:
        check(self)
        if not isinstance(self.r, int) or self.r < 1:
            raise DprGcError(f"--lora-r must be a positive integer, got {self.r!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise DprGcError(f"--lora-alpha must be positive, got {self.alpha}")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise DprGcError(f"--lora-dropout must lie in [0, 1), got {self.dropout}")
        if self.target_modules is not None and not list(self.target_modules):
            raise DprGcError("--lora-target-modules needs at least one module name")


def saved_adapter(folder: Path) -> Optional[LoraSettings]:
    """The settings of the LoRA adapter that ``folder`` (a saved retriever, whose query tower's adapter is read, or a
    PEFT adapter folder) carries; None when it carries none."""
    towers = read_pipeline(folder) if folder.is_dir() else None
    files = [folder / ADAPTER_CONFIG] + [t.transformer / ADAPTER_CONFIG for t in (towers or {}).values()]
    found = next((f for f in files if f.is_file()), None)
    if found is None:
        return None
    data = read_json_object(found, "a LoRA adapter config")
    targets = data.get("target_modules") or []
    try:
        return LoraSettings(r=int(data["r"]), alpha=float(data["lora_alpha"]),
                            dropout=float(data.get("lora_dropout") or 0.0),
                            target_modules=sorted([targets] if isinstance(targets, str) else targets))
    except (KeyError, TypeError, ValueError, DprGcError):
        raise DprGcError(f"{found}: not a LoRA adapter config (r, lora_alpha, target_modules); save it again") from None


def resolve_lora(name: str, settings: Optional[LoraSettings]) -> Optional[LoraSettings]:
    """The LoRA settings a run training the model ``name`` records: when it carries an adapter already, which trains
    as saved, that adapter's own settings (``--lora-*`` flags given or not), a flag given (not None) with another value
    than the adapter's refused in one line; else ``settings`` (the flags; None: no LoRA) with the defaults of those
    not given (:func:`lora_defaults`)."""
    saved = saved_adapter(Path(name)) if Path(name).is_dir() else None
    if saved is None:
        return lora_defaults(name, settings) if settings is not None else None
    if settings is None:
        return saved
    targets = ",".join(saved.target_modules or ())
    differ = [f"--lora-r {settings.r}"] if settings.r != saved.r else []
    differ += [f"--lora-alpha {settings.alpha:g}"] if settings.alpha not in (None, saved.alpha) else []
    differ += [f"--lora-dropout {settings.dropout:g}"] if settings.dropout not in (None, saved.dropout) else []
    if settings.target_modules is not None and set(settings.target_modules) != set(saved.target_modules or ()):
        differ.append(f"--lora-target-modules {','.join(settings.target_modules)}")
    if differ:
        raise DprGcError(f"{name} already carries an r={saved.r} adapter (alpha {saved.alpha:g}, dropout "
                         f"{saved.dropout:g}, on {targets}), which trains as saved; drop {' and '.join(differ)}, or "
                         "run dpr-gc merge-lora on it first to put new adapters on the merged weights")
    return saved


def lora_defaults(name: str, settings: LoraSettings) -> LoraSettings:
    """``settings`` for a new adapter on the model ``name``, the values a flag not given takes filled in, so a run
    records (and ``--resume`` compares) the adapter it trains: dropout 0, alpha ``2 r`` and, for a model type of
    :data:`DEFAULT_TARGETS` (read from the model's config), its targets, sorted as the log and the adapter list them.
    Targets found from the model's layer names (an unlisted type) stay None: they need the model loaded."""
    filled = {"dropout": 0.0 if settings.dropout is None else settings.dropout,
              "alpha": float(2 * settings.r) if settings.alpha is None else settings.alpha}
    if settings.target_modules is None:
        model_type = getattr(read_model_config(name), "model_type", None)
        filled["target_modules"] = sorted(DEFAULT_TARGETS[model_type]) if model_type in DEFAULT_TARGETS else None
    return dataclasses.replace(settings, **filled)


def linear_leaf_names(model: nn.Module) -> list[str]:
    """The last name part of every Linear (or GPT-2 style Conv1D) layer of ``model``, deduplicated in model order:
    the names ``--lora-target-modules`` can take."""
    names = [name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if name and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")]
    return list(dict.fromkeys(names))


def default_targets(model: nn.Module) -> list[str]:
    """The Linear layers a new adapter goes on when ``--lora-target-modules`` is not given: :data:`DEFAULT_TARGETS`
    by model type, else Llama's names when the model holds them all."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_TARGETS and set(DECODER_TARGETS) <= set(linear_leaf_names(model)):
        return list(DECODER_TARGETS)
    if model_type not in DEFAULT_TARGETS:
        names = ",".join(linear_leaf_names(model)[:SHOWN_NAMES])
        raise DprGcError(f"no default LoRA target modules for model type {model_type!r}; name the Linear layers "
                         f"to adapt with --lora-target-modules (e.g. {names})")
    return list(DEFAULT_TARGETS[model_type])


def check_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Refuse, in one line, each ``--lora-target-modules`` name that matches no module of ``model`` as peft matches
    them (the whole name or its last dotted parts), naming the model's own Linear layers: peft adapts the names that
    match and ignores the others, silently."""
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise DprGcError(f"--lora-target-modules {', '.join(missing)}: no module of the model is named so; its "
                         f"Linear layers are {', '.join(linear_leaf_names(model)[:SHOWN_NAMES])}")


def _towers(retriever: Any) -> list[Any]:
    """The distinct encoders of a retriever (one when the tower is shared)."""
    return list({id(e): e for e in (retriever.query_encoder, retriever.passage_encoder)}.values())


def apply_lora(retriever: Any, settings: LoraSettings) -> int:
    """Put LoRA adapters on every tower's transformer and freeze its other weights; a tower already carrying an
    adapter (a saved LoRA retriever) has that adapter made trainable instead. Returns the trainable adapter size."""
    peft = peft_module()
    sources = {}
    for encoder in _towers(retriever):
        model = encoder.transformer
        if not is_adapted(model):
            targets = list(settings.target_modules or default_targets(model))
            check_targets(model, targets)
            config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha or 2 * settings.r,
                                     lora_dropout=settings.dropout or 0.0, target_modules=targets, bias="none")
            model_type = getattr(model.config, "model_type", "?")
            default = set(settings.target_modules or ()) == set(DEFAULT_TARGETS.get(model_type, ()))
            sources[id(encoder)] = ("--lora-target-modules" if settings.target_modules and not default else
                                    f"default for {model_type}")  # the defaults a run records are the type's
            base = str(getattr(model.config, "name_or_path", "") or "")
            try:
                with transformers_quiet():  # peft's advice on fan_in_fan_out for GPT-2's Conv1D too
                    model = peft.get_peft_model(model, config)
            except ValueError as e:
                raise DprGcError(f"--lora-target-modules {','.join(targets)}: {str(e).splitlines()[0]}") from None
            if base and Path(base).exists():  # the adapter names its base; absolute, so the folder can move
                model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
            encoder.transformer = model
    return train_adapters(retriever, sources)


def describe_lora(config: Any, targets_from: str) -> str:
    """One line for the log: a PEFT ``LoraConfig``'s rank, alpha, dropout and target modules, and where the targets
    came from (``targets_from``)."""
    targets = config.target_modules
    names = targets if isinstance(targets, str) else ",".join(sorted(targets or ()))
    return (f"LoRA r={config.r} alpha={config.lora_alpha:g} dropout={config.lora_dropout:g} on {names} "
            f"({targets_from})")


def train_adapters(retriever: Any, sources: Optional[dict[int, str]] = None) -> int:
    """Make every tower's LoRA adapter trainable and freeze the rest of its transformer (a saved adapter loads
    frozen); returns the trainable adapter size. Logs each adapter's settings (:func:`describe_lora`), its targets'
    source by the tower's ``id`` in ``sources`` (a new adapter's), else "the saved adapter"."""
    said = set()
    for encoder in _towers(retriever):
        config = getattr(encoder.transformer, "peft_config", {}).get("default")
        if config is not None:
            said.add(describe_lora(config, (sources or {}).get(id(encoder), "the saved adapter")))
    for line in sorted(said):
        logger.info("%s", line)
    for encoder in _towers(retriever):
        for name, param in encoder.transformer.named_parameters():
            # an unused pooler (any pooling but "pooler") gets no gradient, so its adapter stays frozen too
            param.requires_grad_("lora_" in name and (encoder.config.pooling == "pooler" or ".pooler." not in name))
    size = sum(p.numel() for e in _towers(retriever) for p in e.transformer.parameters() if p.requires_grad)
    logger.info("LoRA: %d trainable adapter parameters", size)
    return size


def has_adapters(retriever: Any) -> bool:
    """Whether any tower carries a LoRA adapter (a saved LoRA retriever)."""
    return any(is_adapted(e.transformer) for e in _towers(retriever))


def merge_lora(retriever: Any) -> int:
    """Merge every tower's adapter into its weights (in place); returns how many towers were merged."""
    merged = 0
    for encoder in _towers(retriever):
        if is_adapted(encoder.transformer):
            encoder.transformer = encoder.transformer.merge_and_unload()
            merged += 1
    return merged


@dataclasses.dataclass
class MergeSettings:
    """``dpr-gc merge-lora``: the adapted retriever and the folder for the merged one."""

    model: str = setting("", "--model", type=home_expanded,
                         required=True, help="a saved retriever whose towers carry LoRA adapters")
    output: str = setting("", "--output", type=output_dir, required=True, help="folder for the merged retriever")


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("merge-lora")
    add_arguments(p, MergeSettings)
    p.set_defaults(func=_cli)


@guarded(inputs=("model",), outputs={"output": "whole"})
def _cli(args: argparse.Namespace) -> None:
    from ..base.tables import format_summary
    from .card import card_training

    started = time.perf_counter()
    check_replaceable(Path(args.output))  # before the minutes of loading: a folder of the user's is refused at once
    retriever = Retriever.load(args.model)
    merged = merge_lora(retriever)
    if not merged:
        raise DprGcError(f"{args.model}: no LoRA adapter to merge (a retriever trained with --lora-r has one)")
    retriever.training_info = {**card_training(Path(args.model)), "merged_from": str(args.model)}  # for its card
    retriever.save(args.output)
    logger.info("wrote the merged retriever to %s", args.output)
    print(format_summary({"towers merged": merged, "parameters": f"{sum(p.numel() for p in retriever.parameters()):,}",
                          "output": args.output}, time.perf_counter() - started))
