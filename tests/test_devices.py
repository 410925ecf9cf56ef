"""The one device picker: a bare ``cuda`` names this process's GPU, as ``torch.cuda.set_device`` needs an index;
``--precision auto`` takes bf16 where the hardware computes it, fp16 on older GPUs, fp32 on other CPUs."""

from __future__ import annotations

import pytest
import torch

import dpr_gc.base.devices as devices
from dpr_gc.base.devices import default_device, pick_precision


def test_bare_cuda_means_this_ranks_gpu(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert default_device("cuda") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device("cuda") == "cuda:3"


def test_an_explicit_device_is_kept(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device("cuda:1") == "cuda:1"
    assert default_device("cpu") == "cpu"


@pytest.mark.parametrize("device, bf16, want", [("cuda", True, "bf16"), ("cuda", False, "fp16"), ("cpu", True, "bf16"),
                                                ("cpu", False, None)])
def test_auto_precision_follows_the_hardware(monkeypatch, device, bf16, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: bf16)
    assert pick_precision("auto", torch.device(device)) == want
    assert pick_precision("fp16", torch.device(device)) == "fp16"
    assert pick_precision("fp32", torch.device(device)) is None


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, tmp_path):
    flags = {"avx512f avx512_bf16": True, "amx_bf16 amx_tile": True, "avx2 avx512f": False}
    real = devices.Path
    for line, want in flags.items():
        (tmp_path / "cpuinfo").write_text(f"flags\t\t: fpu {line}\n")
        monkeypatch.setattr(devices, "Path", lambda path: real(tmp_path / "cpuinfo"))
        assert devices.cpu_has_native_bf16() is want
    monkeypatch.setattr(devices, "Path", lambda path: real(tmp_path / "missing"))
    assert devices.cpu_has_native_bf16() is False


@pytest.mark.parametrize("precision, device, native, warned", [
    ("bf16", "cpu", False, True), ("bf16", "cpu", True, False), ("fp32", "cpu", False, False),
    (None, "cpu", False, False), ("bf16", "cuda", False, False)])
def test_bf16_asked_for_on_a_cpu_that_emulates_it_is_named_in_a_warning(monkeypatch, caplog, precision, device, native,
                                                                         warned):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level("WARNING", logger="dpr_gc.base.devices"):
        devices.warn_if_emulated(precision, torch.device(device))
    assert ("--precision bf16 on a CPU without native bf16" in caplog.text) == warned
