"""Checks of the engine's arguments given in code (GradCache, Chunking, the losses): each refuses a value it cannot
use when the object is built, with one :class:`DprGcError` naming the argument and what to pass. numpy integers
count as integers (``np.int64(4)`` from a config or an array), ``True``/``False`` never do."""

from __future__ import annotations

import numbers
from typing import Any

from ..base.errors import DprGcError


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is True or False (a truthy string such as ``"no"`` would silently switch it on)."""
    if not isinstance(value, bool):
        raise DprGcError(f"{name} must be True or False, got {value!r}")
    return value


def is_integer(value: Any) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int when it is an integer (numpy's too) of at least ``minimum``."""
    if not is_integer(value) or value < minimum:
        need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise DprGcError(f"{name} must be {need}, got {value!r}")
    return int(value)


def as_number(name: str, value: Any, lo: float, hi: float) -> float:
    """``value`` as a float when it is a real number (numpy's too, not a bool) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not lo <= float(value) <= hi:
        raise DprGcError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def check_callable(name: str, value: Any, example: str) -> None:
    """Refuse a ``value`` that cannot be called, naming an ``example`` of what to pass. Where the example reads an
    attribute of the model output, a string (that attribute's name, say) is shown as the function that reads it."""
    if callable(value):
        return
    if isinstance(value, str) and value.isidentifier() and example.startswith("lambda out: out."):
        example = f"lambda out: out.{value}"
    raise DprGcError(f"{name} must be callable, got {type(value).__name__} {value!r}: pass e.g. {name}={example}")
