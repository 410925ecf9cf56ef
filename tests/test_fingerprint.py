"""Model fingerprints: every byte of every tensor counts, with names, dtypes and shapes; the legacy form still reads."""

from __future__ import annotations

import re

import pytest
import torch

from dpr_gc.retrieval.fingerprint import (LEGACY_KEY, fingerprint_matches, legacy_weights_fingerprint,
                                          records_agree, weights_fingerprint)


def holding(**tensors: torch.Tensor) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, tensor in tensors.items():
        module.register_buffer(name, tensor)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_the_fingerprint_reads_every_byte_of_every_tensor(dtype: torch.dtype) -> None:
    module = holding(table=torch.zeros(1000, dtype=dtype), scalar=torch.tensor(0, dtype=dtype))
    before = weights_fingerprint(module)
    assert re.fullmatch(r"v2:[0-9a-f]{32}", before)
    for tensor, position in ((module.table, 1), (module.table, 499), (module.table, 999), (module.scalar, 0)):
        tensor.view(-1)[position] = 1
        assert weights_fingerprint(module) != before, (tensor.shape, position)
        tensor.view(-1)[position] = 0
    assert weights_fingerprint(module) == before


def test_names_dtypes_and_shapes_count_beside_the_bytes() -> None:
    base = weights_fingerprint(holding(table=torch.zeros(12, dtype=torch.float32)))
    for other in (holding(table=torch.zeros(3, 4)), holding(table=torch.zeros(12, dtype=torch.int32)),
                  holding(rows=torch.zeros(12))):
        assert weights_fingerprint(other) != base


def test_matching_uses_the_form_of_the_record() -> None:
    module = holding(table=torch.arange(1000, dtype=torch.float32))
    legacy, full = legacy_weights_fingerprint(module), weights_fingerprint(module)
    assert re.fullmatch(r"[0-9a-f]{16}", legacy)
    assert fingerprint_matches(module, legacy) and fingerprint_matches(module, full)
    module.table[1] = -1.0  # between the legacy sample's positions (every 3rd value)
    assert fingerprint_matches(module, legacy) and not fingerprint_matches(module, full)
    assert records_agree({"model_fingerprint": legacy}, {"model_fingerprint": full, LEGACY_KEY: legacy})
    assert not records_agree({"model_fingerprint": legacy}, {"model_fingerprint": full})
