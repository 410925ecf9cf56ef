"""A model name that is neither a local folder nor reachable fails in seconds with one line (not after a minute of
Hub retries): an unreachable Hub is found by one short probe, HF_HUB_OFFLINE is respected, a missing folder is named.
The bound (20 s) is the issue's target; the probe itself gives up after 4 s."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpr_gc.base.errors import DprGcError
from dpr_gc.model.retriever import Retriever

ROOT = Path(__file__).resolve().parent.parent
NAME = "no-such-org/no-such-model"


@pytest.fixture
def silent_endpoint():
    """An endpoint that accepts connections and never answers (a black-holed network): only a timeout ends a
    request to it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


@pytest.fixture
def refusing_endpoint():
    """An endpoint whose port is closed (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def timed_failure(match: str) -> float:
    began = time.perf_counter()
    with pytest.raises(DprGcError, match=match):
        Retriever.load(NAME)
    return time.perf_counter() - began


@pytest.mark.parametrize("kind", ["silent", "refusing"])
def test_unreachable_hub_fails_fast(monkeypatch, kind, silent_endpoint, refusing_endpoint) -> None:
    endpoint = silent_endpoint if kind == "silent" else refusing_endpoint
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert timed_failure(f"cannot load model '{NAME}': it is not a local folder and the Hugging Face Hub "
                         f"\\({endpoint}\\) is unreachable") < 20


def test_offline_setting_is_respected(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert timed_failure("HF_HUB_OFFLINE is set") < 20
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # transformers' own name for it, named in the error
    assert timed_failure(r"TRANSFORMERS_OFFLINE is set \(give a local folder, or unset TRANSFORMERS_OFFLINE\)") < 20


def test_a_name_in_the_hf_cache_goes_to_transformers_and_a_live_endpoint_passes(tmp_path: Path, monkeypatch,
                                                                                   refusing_endpoint) -> None:
    """hub.py: a Hub name whose config is in the Hugging Face cache is left to transformers (no probe, even offline);
    the probe passes an endpoint that answers HTTP at all."""
    import http.server
    import threading

    from dpr_gc.model.hub import check_model_source, probe

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model_source("org/tiny")  # no error: transformers loads it from the cache
    with pytest.raises(DprGcError, match="HF_HUB_OFFLINE is set"):
        check_model_source("org/absent")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert probe(f"http://127.0.0.1:{server.server_address[1]}") is None  # answers (501): reachable
    finally:
        server.shutdown()
        server.server_close()
    assert probe(refusing_endpoint) is not None


def test_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(DprGcError, match="no such folder"):
        Retriever.load(str(tmp_path / "runs" / "final"))


def test_cli_gives_one_error_line(tmp_path: Path, refusing_endpoint) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_ENDPOINT=refusing_endpoint, DPR_GC_CACHE=str(tmp_path / "cache"))
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run([sys.executable, "-m", "dpr_gc", "encode", "--model", NAME, "--corpus",
                             str(ROOT / "data" / "examples" / "passages.tsv"), "--output", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [l for l in result.stderr.splitlines() if l.startswith("error: ")]
    assert len(result.stderr.splitlines()) == 1 and "is unreachable" in result.stderr


@pytest.mark.parametrize("offline", [True, False])
def test_a_dpr_checkpoint_naming_an_unreachable_hub_config_fails_fast(tmp_path: Path, monkeypatch, offline,
                                                                       silent_endpoint) -> None:
    """A DPR ``.cp`` whose ``pretrained_model_cfg`` is a Hub name goes through the same check as ``--model``: refused
    within seconds, naming the file, with the Hub off or black-holed (transformers would retry for minutes)."""
    import torch

    checkpoint = tmp_path / "dpr_biencoder.0.cp"
    torch.save({"model_dict": {"question_model.embeddings.word_embeddings.weight": torch.zeros(2, 2)},
                "encoder_params": {"pretrained_model_cfg": NAME}}, checkpoint)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", silent_endpoint)
    began = time.perf_counter()
    expected = f"{checkpoint}: its encoder_params.pretrained_model_cfg: cannot load model '{NAME}': it is not a local"
    with pytest.raises(DprGcError, match=f"^{re.escape(expected)} folder"):
        Retriever.load(checkpoint)
    assert time.perf_counter() - began < 20


@pytest.mark.parametrize("value,off", [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("On", True),
                                       ("0", False), ("false", False), ("no", False), ("", False)])
def test_every_spelling_huggingface_hub_takes_for_offline_is_respected(monkeypatch, refusing_endpoint, value,
                                                                       off) -> None:
    """hub.py respects HF_HUB_OFFLINE as huggingface_hub reads it (1, true, yes, on, any case): a spelling it missed
    probed the Hub instead and blamed the network, not the variable the user set."""
    from dpr_gc.model.hub import check_model_source

    monkeypatch.setenv("HF_ENDPOINT", refusing_endpoint)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    with pytest.raises(DprGcError) as e:
        check_model_source(NAME)
    assert ("HF_HUB_OFFLINE is set" in str(e.value)) == off, str(e.value)
    assert ("is unreachable" in str(e.value)) != off, str(e.value)


@pytest.mark.parametrize("name", ["runs/nq/best", "./best", "../best", "~/no-such-dpr-gc-model", "/abs/best",
                                  "runs\\best"])
def test_a_missing_path_is_named_as_no_such_folder_without_asking_the_hub(tmp_path: Path, monkeypatch,
                                                                          name: str) -> None:
    """hub.py: a name the Hub could not hold (more than one ``/``, or starting ``/``, ``.``, ``~``, or with ``\\``) is
    a missing folder, said at once; only an ``org/model`` name is probed (a mistyped ``runs/nq/best`` was blamed on
    an unreachable Hub)."""
    from dpr_gc.model import hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "probe", lambda *args, **kwargs: pytest.fail(f"the Hub was probed for {name!r}"))
    with pytest.raises(DprGcError, match=f"^cannot load model {re.escape(repr(name))}: no such folder"):
        hub.check_model_source(name)
