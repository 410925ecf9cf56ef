"""The one device picker: a bare ``cuda`` names this process's GPU, as ``torch.cuda.set_device`` needs an index."""

from __future__ import annotations

from dpr_gc.base.devices import default_device


def test_bare_cuda_means_this_ranks_gpu(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert default_device("cuda") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device("cuda") == "cuda:3"


def test_an_explicit_device_is_kept(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device("cuda:1") == "cuda:1"
    assert default_device("cpu") == "cpu"
