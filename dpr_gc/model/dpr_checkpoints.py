"""Read a DPR / GC-DPR bi-encoder training checkpoint (``dpr_biencoder.N.cp``) as a :class:`Retriever`, without
unpickling code (the Hub's transformers DPR pairs are :mod:`dpr_gc.model.dpr_hub`).

DPR saves ``{model_dict, optimizer_dict, scheduler_dict, offset, epoch, encoder_params}`` with ``torch.save``; all of
it is tensors, numbers, strings and containers, so ``torch.load(weights_only=True)`` reads it. ``model_dict`` holds
``question_model.*`` and ``ctx_model.*`` (Hugging Face BERT weights, plus ``encode_proj`` with a projection);
``encoder_params`` names the Hugging Face config (``pretrained_model_cfg``), the projection and the sequence length,
itself (argparse-era DPR, GC-DPR) or in its ``encoder`` (hydra-era DPR). A file holding objects (hydra's
``DictConfig``) is refused with a command that converts it to plain dicts. DPR pools the
[CLS] state and scores by dot product, which is what the returned retriever does.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

import torch

from ..base.errors import DprGcError
from ..base.files import torch_load_weights, weights_only_reason
from .config import RetrieverConfig
from .hub import check_model_source
from .pretrained import load_tokenizer, missing_layers

# The settings become plain nested dicts: a mapping (hydra's DictConfig) by its keys, a list config as a list, an
# attribute bag (argparse.Namespace) by its attributes.
CONVERT_CODE = ('import json, torch; s = torch.load({path}, weights_only=False); p = json.loads(json.dumps('
                's["encoder_params"], default=lambda o: dict(o) if hasattr(o, "keys") else list(o) if hasattr(o, '
                '"__iter__") else vars(o))); torch.save({{"model_dict": dict(s["model_dict"]), "encoder_params": p}}, '
                '{safe})')


def python_string(text: str) -> str:
    """``text`` as a Python string literal in double quotes where ``repr``'s single ones may be swapped for them
    (the literal then needs no escaping inside the shell's single quotes), else ``repr``'s."""
    literal = repr(text)
    return f'"{literal[1:-1]}"' if literal[0] == "'" and '"' not in text else literal


def convert_hint(path: str) -> str:
    """The command that converts the checkpoint ``path`` to plain data in ``path.safe``, and to pass that file: the
    paths are a Python literal in a shell-quoted ``python -c`` argument, so the command runs as printed whatever
    they hold (a quote, a space)."""
    code = CONVERT_CODE.format(path=python_string(path), safe=python_string(f"{path}.safe"))
    return f"convert it where you trust the file: python -c {shlex.quote(code)} and pass {shlex.quote(path + '.safe')}"


logger = logging.getLogger(__name__)


def read_dpr_state(path: str | Path) -> dict:
    """The checkpoint's dict, read with ``weights_only=True``. A file that is no torch checkpoint, or one without
    DPR's ``model_dict``, is refused as "cannot load model 'PATH'" (a command names its flag there), the unpickler's
    own reason logged at debug level; one holding Python objects is refused with how to convert it."""
    name = str(path)
    refuse_weights_file(Path(path))
    try:
        state = torch_load_weights(Path(path))
    except Exception as e:  # noqa: BLE001 - pickle and zip errors of any kind mean the same to the user
        reason = weights_only_reason(e)
        if "GLOBAL" not in reason:  # not a torch checkpoint at all, rather than one holding Python objects
            logger.debug("%s: torch.load(weights_only=True) refused it: %s", name, reason)
            raise DprGcError(f"cannot load model {name!r}: not a model folder nor a DPR .cp checkpoint (give a dpr-gc "
                             "retriever folder, a Hugging Face model name or folder, or a DPR .cp file)") from None
        raise DprGcError(f"cannot load model {name!r}: it cannot be read as weights only ({reason}); "
                         + convert_hint(name)) from None
    if not isinstance(state, dict) or not isinstance(state.get("model_dict"), dict):
        refuse_weights_file(Path(path), model_folder=True)
        raise DprGcError(f"cannot load model {name!r}: not a model folder nor a DPR .cp checkpoint (a torch file "
                         "without DPR's 'model_dict'; give a dpr-gc retriever folder, a Hugging Face model name or "
                         "folder, or a DPR .cp file)")
    return state


def refuse_weights_file(path: Path, model_folder: bool = False) -> None:
    """Refuse, saying to pass its folder, a model's weights file given as the model: a ``.safetensors`` file, or
    (``model_folder``: a torch file without DPR's ``model_dict``) one beside a ``config.json``."""
    if path.suffix == ".safetensors" or (model_folder and (path.parent / "config.json").is_file()):
        raise DprGcError(f"cannot load model {str(path)!r}: a weights file of a model, not a DPR .cp checkpoint; "
                         f"pass the folder {path.parent} that holds it with its config.json")


def encoder_settings(state: dict, path: Path) -> dict:
    """The encoder's settings of a DPR checkpoint: ``encoder_params`` itself (argparse-era DPR, GC-DPR) or its
    ``encoder`` (hydra-era DPR saves ``{"do_lower_case": ..., "encoder": cfg.encoder}``)."""
    params = state.get("encoder_params") or {}
    if not isinstance(params, dict):
        raise DprGcError(f"{path}: encoder_params is a {type(params).__name__}, not a dict of settings")
    encoder = params.get("encoder", params)
    if not isinstance(encoder, dict):
        raise DprGcError(f"{path}: encoder_params.encoder is a {type(encoder).__name__}, not a dict of settings")
    return encoder


def _tower(model_dict: dict, prefix: str) -> tuple[dict, dict]:
    weights = {k[len(prefix):]: v for k, v in model_dict.items() if k.startswith(prefix)}
    projection = {k[len("encode_proj."):]: weights.pop(k) for k in list(weights) if k.startswith("encode_proj.")}
    if not weights:
        raise DprGcError(f"DPR checkpoint has no '{prefix}*' weights")
    return weights, projection


def load_dpr_checkpoint(retriever_cls: Any, path: str | Path) -> Any:
    """A ``retriever_cls`` (the :class:`~dpr_gc.model.retriever.Retriever` whose ``load`` calls this) with DPR's two
    towers, CLS pooling, dot product and optional projection."""
    from transformers import AutoConfig, AutoModel

    p = Path(path)
    state = read_dpr_state(path)
    params = encoder_settings(state, p)
    name = params.get("pretrained_model_cfg")
    if not name:
        raise DprGcError(f"{p}: encoder_params has no pretrained_model_cfg, so the model config is unknown")
    if params.get("encoder_model_type") not in (None, "hf_bert"):
        raise DprGcError(f"{p}: encoder_model_type {params['encoder_model_type']!r} is not supported (only hf_bert)")
    try:  # a Hub name is refused within seconds offline, not after transformers' minute of retries
        check_model_source(str(name))
    except DprGcError as e:
        raise DprGcError(f"{p}: its encoder_params.pretrained_model_cfg: {e}") from None
    try:
        hf_config = AutoConfig.from_pretrained(str(name), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DprGcError(f"{p}: cannot load the config {name!r} it was trained from: {str(e).splitlines()[0]}") from None
    missing = missing_layers(hf_config.to_dict(), list(state["model_dict"]))
    if missing:
        raise DprGcError(f"{p}: the config {name!r} it names makes {missing[1]:,} layers ({missing[0]}) but the "
                         f"checkpoint holds {missing[2]}; point pretrained_model_cfg at the config it was trained from")
    length = int(params.get("sequence_length") or 256)
    projection_dim = int(params.get("projection_dim") or 0) or None
    config = RetrieverConfig(pooling="cls", shared_encoder=False, projection_dim=projection_dim,
                             query_max_length=length, passage_max_length=length)
    towers = {}
    for side, prefix in (("query", "question_model."), ("passage", "ctx_model.")):
        weights, projection = _tower(state["model_dict"], prefix)
        model = AutoModel.from_config(hf_config, add_pooling_layer="pooler.dense.weight" in weights,
                                      dtype=torch.float32)  # not the config's saved dtype: precision is autocast's
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise DprGcError(f"{p}: {prefix} weights do not fit {name!r} (missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]})")
        towers[side] = (model, projection)
    tokenizer = load_tokenizer(str(name), towers["query"][0])
    retriever = retriever_cls(towers["query"][0], towers["passage"][0], tokenizer, config)
    for encoder, (_, projection) in ((retriever.query_encoder, towers["query"]),
                                     (retriever.passage_encoder, towers["passage"])):
        if encoder.projection is not None:
            encoder.projection.load_state_dict(projection)
    return retriever
