"""Validated reading of the files other programs (or damaged copies) hand us: typed JSON fields with ranges, paths a
folder declares kept inside that folder, model folders that would run their own code refused, and safetensors
headers checked before any tensor is read -- each failure one :class:`DprGcError` line naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .errors import DprGcError
PathLike = Union[str, os.PathLike]

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
CUSTOM_CODE_KEYS = ("auto_map", "custom_pipelines")


class Field:
    """One JSON field: its Python types (``bool`` is never taken for ``int``), whether null is allowed, and an
    optional test of the value with the words that describe what it must be."""

    def __init__(self, kinds: Union[type, tuple], nullable: bool = False, test: Optional[Callable[[Any], bool]] = None,
                 need: str = "") -> None:
        self.kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        self.nullable, self.test = nullable, test
        names = "/".join({"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                          "list": "a list", "dict": "an object"}[k.__name__] for k in self.kinds)
        self.need = need or names + (" or null" if nullable else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) and bool not in self.kinds:
            return False
        if not isinstance(value, self.kinds):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return self.test is None or bool(self.test(value))


def positive_int(nullable: bool = False) -> Field:
    return Field(int, nullable, lambda v: v >= 1, "a positive integer" + (" or null" if nullable else ""))


def count(nullable: bool = False) -> Field:
    return Field(int, nullable, lambda v: v >= 0, "an integer >= 0" + (" or null" if nullable else ""))


def number(test: Optional[Callable[[float], bool]] = None, need: str = "a finite number") -> Field:
    return Field((int, float), False, test, need)


def one_of(choices: Sequence[str]) -> Field:
    """A string from ``choices`` (the same tuple the matching flag is declared with)."""
    return Field(str, False, lambda v: v in choices, f"one of {', '.join(choices)}")


def text(nullable: bool = False) -> Field:
    return Field(str, nullable, no_lone_surrogates, "a string" + (" or null" if nullable else ""))


def no_lone_surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_fields(data: Any, source: PathLike, fields: Mapping[str, Field], what: str = "file",
                 required: Sequence[str] = ()) -> dict:
    """Check the fields of the JSON object ``data`` read from ``source`` (absent fields are left to defaults unless
    ``required``); returns ``data``."""
    if not isinstance(data, dict):
        raise DprGcError(f"{source}: expected a JSON object ({what}), got a {type(data).__name__}; the file is "
                         "damaged or not one dpr-gc reads")
    for key in required:
        if key not in data:
            raise DprGcError(f"{source}: {key!r} is missing ({what}); the file is damaged or not one dpr-gc reads")
    for key, field in fields.items():
        if key in data and not field.accepts(data[key]):
            shown = json.dumps(data[key], ensure_ascii=True)[:60]
            raise DprGcError(f"{source}: {key!r} must be {field.need}, got {shown} ({what}); fix the file or save "
                             "it again")
    return data


def check_list(data: Any, source: PathLike, item: Callable[[Any, str], None], what: str) -> list:
    """A JSON list whose items pass ``item(value, where)``."""
    if not isinstance(data, list):
        raise DprGcError(f"{source}: expected a JSON list ({what}), got a {type(data).__name__}; the file is "
                         "damaged or not one dpr-gc reads")
    for i, value in enumerate(data):
        item(value, f"{source} (item {i})")
    return data


def inside(folder: PathLike, relative: Any, source: PathLike, key: str) -> Path:
    """``folder / relative``, refused unless it is a relative path that stays inside ``folder`` (no absolute path, no
    ``..`` out of it): a folder may only point at its own files."""
    if not isinstance(relative, str) or not no_lone_surrogates(relative):
        raise DprGcError(f"{source}: {key!r} must be a path string, got {json.dumps(relative, ensure_ascii=True)[:60]}")
    root = os.path.normpath(os.path.abspath(folder))  # by name: a link the folder holds is its own file
    target = os.path.normpath(os.path.join(root, relative))
    if os.path.isabs(relative) or os.path.commonpath([root, target]) != root:
        raise DprGcError(f"{source}: {key} {relative!r} points outside {folder}; a folder may only name its own "
                         "files (copy what it needs into it)")
    return Path(folder) / relative


def refuse_custom_code(folder: PathLike) -> None:
    """Refuse a model folder whose configuration asks to run its own Python code (``auto_map``): nothing from a
    model folder is ever executed."""
    root = Path(folder)
    if not root.is_dir():
        return
    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json", "adapter_config.json"):
        path = root / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise DprGcError(f"{path}: cannot read ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if isinstance(data, dict) and any(data.get(key) for key in CUSTOM_CODE_KEYS):
            raise DprGcError(f"{path}: this model folder asks to run its own code (auto_map); dpr-gc never runs code "
                             "from a model folder -- use a model of a standard architecture")
        if isinstance(data, dict) and "auto_map" in str(data.get("text_config", "")):
            raise DprGcError(f"{path}: this model folder asks to run its own code (auto_map); refused")


def check_safetensors(path: PathLike) -> list[str]:
    """Check a ``.safetensors`` file's header before anything reads it: a sane header length, known dtypes, shapes
    that match their byte ranges, ranges that neither overlap nor leave the file, and nothing cut off. Returns the
    names of the tensors it holds."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
                _damaged(p, f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n).decode("utf-8"))
    except DprGcError:  # a ValueError itself: the header length's own message, not wrapped in another
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _damaged(p, f"unreadable header ({str(e).splitlines()[0][:80]})")
    except OSError as e:
        raise DprGcError(f"{p}: cannot read ({e.strerror or e})") from None
    if not isinstance(header, dict):
        _damaged(p, "the header is not a JSON object")
    data_bytes, ranges = size - 8 - n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in DTYPE_BYTES:
            _damaged(p, f"tensor {name!r} has no known dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            _damaged(p, f"tensor {name!r} has a malformed shape or byte range")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            _damaged(p, f"tensor {name!r} claims bytes {begin}..{end} but the file holds {data_bytes} (cut off?)")
        if math.prod(shape) * DTYPE_BYTES[info["dtype"]] != end - begin:
            _damaged(p, f"tensor {name!r} of shape {shape} does not fit its {end - begin} bytes")
        ranges.append((begin, end, name))
    ranges.sort()
    for (b1, e1, n1), (b2, _, n2) in zip(ranges, ranges[1:]):
        if b2 < e1:
            _damaged(p, f"tensors {n1!r} and {n2!r} overlap")
    return [name for _, _, name in ranges]


def _damaged(path: Path, reason: str) -> None:
    raise DprGcError(f"{path}: damaged safetensors file ({reason}); copy or save it again")


def check_weights_folder(folder: PathLike) -> list[str]:
    """Check every safetensors file directly in a model folder (:func:`check_safetensors`); the names of the
    weights they hold."""
    root = Path(folder)
    return [name for p in sorted(root.glob("*.safetensors")) for name in check_safetensors(p)] if root.is_dir() else []


def given_id(record: Mapping[str, Any], keys: Sequence[str] = ("_id", "id")) -> Any:
    """The id ``record`` gives: the value of the first of ``keys`` (BEIR's ``_id`` before ``id``) that is neither
    null nor an empty or whitespace-only string, so a null ``_id`` beside a real ``id`` never hides it; None when
    there is none."""
    return next((record[k] for k in keys if not blank_id(record.get(k))), None)


def blank_id(value: Any) -> bool:
    """Whether ``value`` gives no id: null, or a string that is empty or only whitespace."""
    return value is None or (isinstance(value, str) and not value.strip())


def check_id(value: Any, where: str, what: str = "id") -> str:
    """An id as text, refused (never silently normalised) when two ids could look the same but differ: control or
    invisible format characters (NUL, zero-width, right-to-left marks) or a form other than Unicode NFC; a lone
    surrogate, null, a boolean or a non-scalar are refused too."""
    import unicodedata

    if value is None or isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DprGcError(f"{where}: {what} must be a string or an integer, got {json.dumps(value, ensure_ascii=True)[:60]}")
    text_id = str(value)
    if not no_lone_surrogates(text_id):
        raise DprGcError(f"{where}: {what} {ascii(text_id)[:60]} holds a lone surrogate (broken UTF-16); fix the file")
    bad = [c for c in text_id if unicodedata.category(c) in ("Cc", "Cf")]
    if bad:
        raise DprGcError(f"{where}: {what} {ascii(text_id)[:60]} holds invisible or control characters "
                         f"({', '.join(f'U+{ord(c):04X}' for c in bad[:3])}); remove them")
    if unicodedata.normalize("NFC", text_id) != text_id:
        raise DprGcError(f"{where}: {what} {ascii(text_id)[:60]} is not in Unicode NFC form, so it could differ from a "
                         "visually identical id; normalise the file to NFC")
    return text_id
