"""Frozen Linear weights stored in autocast's precision for the length of a cached step.

Autocast keeps one low-precision copy of a weight that requires grad for as long as its outermost context is open,
but casts a frozen weight (a LoRA base layer's) afresh at every call, and a forward with a graph saves that fresh
copy for its backward. A cached step calls its model once per chunk in each pass, so every chunk casts every frozen
weight again and every kept graph holds copies of its own: for a Qwen2-0.5B base in bf16 that is 0.72 GB per kept
chunk, which plain training pays once per encoder call. Inside :class:`FrozenLinearCasts` each frozen fp32
``nn.Linear`` weight and bias is cast once to the autocast dtype, and the module's calls made under that autocast use
the copy, so chunks cast nothing and their graphs all save that one copy; calls outside autocast (a model that turns
it off around a layer, a loss that applies the layer) use the fp32 parameter, as they would without the step.
Exact: autocast runs ``linear`` in that dtype and would have rounded the fp32 tensor to the same values.

The engine switches only models that train: their graphs save a copy of each frozen weight on the gradient's path
anyway, while a frozen tower runs without a graph and holds each cast only for as long as its call lasts. Only
tensors that no other module reads are switched (a tied embedding table is looked up outside autocast's cast list),
only modules whose type is exactly ``nn.Linear`` (a subclass may read its weight in a forward of its own) and whose
``forward`` nobody replaced, and only plain tensors (FSDP2 shards are DTensors and cast by FSDP's own mixed-precision
policy).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

# Parameter dtypes autocast lowers (it leaves float64 as it is).
CAST_DTYPES = (torch.float32,)


def castable_linears(models: Sequence[nn.Module],
                     dtypes: Mapping[str, torch.dtype]) -> list[tuple[nn.Linear, list[str]]]:
    """Each exact ``nn.Linear`` of ``models`` (its ``forward`` not replaced) with the names of its frozen tensors that
    autocast would lower to ``dtypes[device type]`` at every call: fp32, plain tensors, on a device with an autocast
    dtype, held by no other module. One walk of each distinct model's modules (tied towers are one model)."""
    owners: dict[int, set[tuple[int, str]]] = {}  # parameter -> the (module, attribute) slots that hold it
    linears = []
    for model in {id(m): m for m in models}.values():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                owners.setdefault(id(param), set()).add((id(module), name))
            if type(module) is nn.Linear and "forward" not in vars(module):
                linears.append(module)
    found = {}
    for module in linears:
        names = [name for name in ("weight", "bias") if _castable(getattr(module, name), dtypes, owners)]
        if names:
            found[id(module)] = (module, names)
    return list(found.values())


def _castable(param: Optional[nn.Parameter], dtypes: Mapping[str, torch.dtype], owners: dict) -> bool:
    return (param is not None and not param.requires_grad and param.dtype in CAST_DTYPES
            and type(param.data) is torch.Tensor and param.device.type in dtypes and len(owners[id(param)]) == 1)


def _linear_with_copies(module: nn.Linear, copies: dict[str, Any], input: torch.Tensor) -> torch.Tensor:
    """``module``'s forward inside the step: its low-precision ``copies`` under an autocast of their dtype on its
    device, its own tensors otherwise (and after the step, when ``copies`` is empty)."""
    device = copies.get("device")
    if device and torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == copies["dtype"]:
        return nn.functional.linear(input, copies.get("weight", module.weight), copies.get("bias", module.bias))
    return nn.functional.linear(input, module.weight, module.bias)


# A switched module's forward for every step of one engine: module id -> (module, forward, its copies' dict).
Forwards = dict[int, tuple[nn.Linear, Callable[[torch.Tensor], torch.Tensor], dict[str, Any]]]


class FrozenLinearCasts:
    """Context of one cached step: the modules of :func:`castable_linears` of ``models`` run their calls under
    autocast with a copy of their frozen tensors in its dtype, made on entry and dropped on exit (also when the step
    fails); their parameters are never touched. ``dtypes`` maps a device type to the autocast dtype the step's chunks
    run in there; a device without one is left alone. :attr:`copies` lists the copies (held for the step, not by any
    one graph). ``forwards`` (the engine's, kept from step to step) gives a module the same forward object in every
    step: ``torch.compile`` guards on it, and a new one each step would recompile the model at every step."""

    def __init__(self, models: Sequence[nn.Module], dtypes: Mapping[str, torch.dtype],
                 forwards: Optional[Forwards] = None) -> None:
        self.linears = castable_linears(models, dtypes) if dtypes else []
        self.dtypes = dict(dtypes)
        self.forwards: Forwards = {} if forwards is None else forwards
        self.copies: list[torch.Tensor] = []

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters whose calls under autocast use a copy."""
        return [getattr(module, name) for module, names in self.linears for name in names]

    def __enter__(self) -> FrozenLinearCasts:
        current = {id(module): module for module, _ in self.linears}
        for key in [key for key, entry in self.forwards.items() if current.get(key) is not entry[0]]:
            del self.forwards[key]  # a module no longer switched, or gone
        for module, names in self.linears:
            entry = self.forwards.get(id(module))
            if entry is None:
                copies: dict[str, Any] = {}
                entry = self.forwards[id(module)] = (module, functools.partial(_linear_with_copies, module, copies),
                                                     copies)
            device = module.weight.device.type
            dtype = self.dtypes[device]
            entry[2].update({name: getattr(module, name).detach().to(dtype) for name in names}, dtype=dtype,
                            device=device)
            module.forward = entry[1]
            self.copies.extend(entry[2][name] for name in names)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, _ in self.linears:
            vars(module).pop("forward", None)
            self.forwards[id(module)][2].clear()
        self.copies = []
