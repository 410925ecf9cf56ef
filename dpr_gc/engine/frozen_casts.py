"""Frozen Linear weights stored in autocast's precision for the length of a cached step.

Autocast keeps one low-precision copy of a weight that requires grad for as long as its outermost context is open,
but casts a frozen weight (a LoRA base layer's) afresh at every call, and a forward with a graph saves that fresh
copy for its backward. A cached step calls its model once per chunk in each pass, so every chunk casts every frozen
weight again and every kept graph holds copies of its own: for a Qwen2-0.5B base in bf16 that is 0.72 GB per kept
chunk, which plain training pays once per encoder call. Inside :class:`FrozenLinearCasts` each frozen fp32
``nn.Linear`` weight and bias is stored in the autocast dtype instead, so chunks cast nothing and their graphs save
the parameter itself; the fp32 tensors are put back on exit. Exact: autocast runs ``linear`` in that dtype and
would have rounded the fp32 tensor to the same values.

The engine switches only models that train: their graphs save a copy of each frozen weight on the gradient's path
anyway, while a frozen tower runs without a graph and holds each cast only for as long as its call lasts. Only
tensors that no other module reads are switched (a tied embedding table is looked up outside autocast's cast list),
only modules whose type is exactly ``nn.Linear`` (a subclass may read its weight outside autocast), and only plain
tensors (FSDP2 shards are DTensors and cast by FSDP's own mixed-precision policy).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

# Parameter dtypes autocast lowers (it leaves float64 as it is).
CAST_DTYPES = (torch.float32,)


def castable_linear_params(models: Sequence[nn.Module], dtypes: Mapping[str, torch.dtype]) -> list[nn.Parameter]:
    """The frozen weights and biases of exact ``nn.Linear`` modules in ``models`` that autocast would lower to
    ``dtypes[device type]`` at every call: fp32, plain tensors, on a device with an autocast dtype, held by no
    other module. One walk of each distinct model's modules (tied towers are one model)."""
    owners: dict[int, set[tuple[int, str]]] = {}  # parameter -> the (module, attribute) slots that hold it
    linears = []
    for model in {id(m): m for m in models}.values():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                owners.setdefault(id(param), set()).add((id(module), name))
            if type(module) is nn.Linear:
                linears.append(module)
    found = {}
    for module in linears:
        for param in (module.weight, module.bias):
            if (param is not None and not param.requires_grad and param.dtype in CAST_DTYPES
                    and type(param.data) is torch.Tensor and param.device.type in dtypes
                    and len(owners[id(param)]) == 1):
                found[id(param)] = param
    return list(found.values())


class FrozenLinearCasts:
    """Context of one cached step: :func:`castable_linear_params` of ``models`` hold their autocast-dtype copy
    inside it and their own fp32 tensor again on exit (also when the step fails). ``dtypes`` maps a device type to
    the autocast dtype the step's chunks run in there; a device without one is left alone."""

    def __init__(self, models: Sequence[nn.Module], dtypes: Mapping[str, torch.dtype]) -> None:
        self.params = castable_linear_params(models, dtypes) if dtypes else []
        self.dtypes = dict(dtypes)
        self.originals: list[torch.Tensor] = []

    def __enter__(self) -> FrozenLinearCasts:
        for param in self.params:
            self.originals.append(param.data)
            param.data = param.data.to(self.dtypes[param.device.type])
        return self

    def __exit__(self, *exc: object) -> None:
        for param, original in zip(self.params, self.originals):
            param.data = original
        self.originals = []
