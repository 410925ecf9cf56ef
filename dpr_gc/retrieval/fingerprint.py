"""Model fingerprints: which weights encoded a set of passages, so they are never searched with another model.

A fingerprint is written as ``v2:`` and 32 hex digits: blake2b over every byte of every tensor of the module's state
dict, with its name, dtype and shape, in name order. Encode manifests and index metadata record it; ``encode``
(resuming), ``index`` and ``retrieve``/``mine`` compare it. Records written by earlier versions hold the legacy form,
16 hex digits hashing a strided sample of about 256 values per tensor: they are still compared, by recomputing that
sample, which misses an edit between the sampled positions. A shard encoded into a folder holding legacy records also
records the model's legacy fingerprint (``legacy_model_fingerprint``), so its shards and an index built from them
are recognised as one model's.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Mapping, Optional, Sequence

VERSION = "v2"
LEGACY_KEY = "legacy_model_fingerprint"


def weights_fingerprint(module: Any) -> str:
    """``v2:`` + 32 hex digits hashing every byte of ``module``'s state dict (names, dtypes and shapes too), one
    tensor at a time on the CPU, in its own dtype (bf16 and others as raw bytes, nothing upcast)."""
    import torch

    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{name}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return f"{VERSION}:{digest.hexdigest()}"


def legacy_weights_fingerprint(module: Any) -> str:
    """The legacy fingerprint (16 hex digits): sha1 over a strided sample of about 256 values of each tensor with its
    name and shape -- kept only to compare records written in that form."""
    digest = hashlib.sha1()
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)].float().cpu().numpy()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.tobytes())
    return digest.hexdigest()[:16]


def model_fingerprint(retriever: Any) -> str:
    """The fingerprint of a retriever's passage encoder, the weights that made a set of embeddings."""
    return weights_fingerprint(retriever.passage_encoder)


def is_legacy(recorded: Optional[str]) -> bool:
    """Whether a recorded fingerprint is in the legacy form (no ``vN:`` prefix)."""
    return isinstance(recorded, str) and ":" not in recorded


def fingerprint_matches(module: Any, recorded: str) -> bool:
    """Whether ``module``'s weights are those a record names: the legacy sampled hash for a legacy record, else the
    full one."""
    return (legacy_weights_fingerprint(module) if is_legacy(recorded) else weights_fingerprint(module)) == recorded


def records_agree(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two records (encode manifests, index metadata) name one model: equal fingerprints of one form, or a
    legacy one equal to the other record's ``legacy_model_fingerprint``."""
    fa, fb = a.get("model_fingerprint"), b.get("model_fingerprint")
    if is_legacy(fa) == is_legacy(fb):
        return fa == fb
    legacy, current = (fa, b) if is_legacy(fa) else (fb, a)
    return legacy == current.get(LEGACY_KEY)


def disagreeing(records: Sequence[Mapping[str, Any]]) -> Optional[tuple[Mapping, Mapping]]:
    """The first pair of ``records`` that do not name one model (see :func:`records_agree`), else None."""
    kinds = {(r.get("model_fingerprint"), r.get(LEGACY_KEY)): r for r in records}
    return next(((a, b) for a, b in itertools.combinations(kinds.values(), 2) if not records_agree(a, b)), None)


def combined(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The fingerprint fields for a record covering ``records`` of one model (an index over shards): the full
    fingerprint where one is known, else the legacy one, plus the legacy one beside a full one."""
    recorded = [r.get("model_fingerprint") for r in records]
    full = [f for f in recorded if f and not is_legacy(f)]
    legacy = [f for f in recorded if is_legacy(f)]
    legacy += [r[LEGACY_KEY] for r in records if r.get(LEGACY_KEY)]
    fields: dict[str, Any] = {"model_fingerprint": (full or legacy or [None])[0]}
    if full and legacy:
        fields[LEGACY_KEY] = legacy[0]
    return fields


def bridge_legacy(record: dict, module: Any, others: Sequence[Mapping[str, Any]]) -> None:
    """Add ``module``'s legacy fingerprint to ``record`` when one of ``others`` (records in the same folder) holds
    the legacy form, so that :func:`records_agree` can tell whether they name the same model."""
    if any(is_legacy(r.get("model_fingerprint")) for r in others):
        record[LEGACY_KEY] = legacy_weights_fingerprint(module)
