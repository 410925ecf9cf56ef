"""scripts/download_dpr_data.py against a local HTTP server: verified downloads, one-line errors offline and on
damaged or mismatching files, nothing half-written."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import json
import socket
import threading

import pytest

from tests.helpers import load_script


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/short.csv":
            return super().do_GET()
        self.send_response(200)  # declares 1,000 bytes, sends 100 and closes: a connection cut mid-file
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"x" * 100)
        self.close_connection = True


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_downloads_are_verified_and_recorded(server, tmp_path, monkeypatch, capsys):
    root, url = server
    qa = b'who wrote hamlet\t["Shakespeare"]\n'
    (root / "qa.csv").write_bytes(qa)
    (root / "train.json.gz").write_bytes(gzip.compress(b'[{"question": "q"}]'))
    whole = gzip.compress(b"passage text " * 5000)
    (root / "broken.tsv.gz").write_bytes(whole[:len(whole) // 2])
    bad_crc = bytearray(whole)
    bad_crc[-8] ^= 0xFF  # a whole member whose CRC-32 does not match its data
    (root / "crc.tsv.gz").write_bytes(bytes(bad_crc))
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {
        "qa": (f"{url}/qa.csv", "qa.csv", "", hashlib.sha256(qa).hexdigest()),
        "train": (f"{url}/train.json.gz", "train.json.gz", "", None),
        "wrong-sha": (f"{url}/qa.csv", "other.csv", "", "0" * 64),
        "broken": (f"{url}/broken.tsv.gz", "broken.tsv.gz", "", None),
        "crc": (f"{url}/crc.tsv.gz", "crc.tsv.gz", "", None),
        "short": (f"{url}/short.csv", "short.csv", "", None),
        "missing": (f"{url}/nope.csv", "nope.csv", "", None),
        "offline": (f"http://127.0.0.1:{closed_port()}/x.csv", "x.csv", "", None),
    })
    out = tmp_path / "dpr"
    assert script.main(["--output", str(out), "qa", "train"]) == 0
    sums = json.loads((out / "SHA256SUMS.json").read_text())
    assert (out / "qa.csv").read_bytes() == qa
    assert sums["train.json.gz"]["sha256"] == hashlib.sha256((root / "train.json.gz").read_bytes()).hexdigest()
    capsys.readouterr()
    for name, message in (("wrong-sha", "does not match the expected"), ("broken", "not an intact gzip"),
                          ("crc", "not an intact gzip"), ("short", "is incomplete (100 of 1000 bytes)"),
                          ("missing", "HTTP 404"), ("offline", "cannot download")):
        assert script.main(["--output", str(out), name]) == 2
        assert message in one_error(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS.json", "qa.csv", "train.json.gz"]

    assert script.main(["--output", str(out), "--verify", "qa", "train"]) == 0
    (out / "train.json.gz").write_bytes(gzip.compress(b'[{"question": "changed"}]'))
    assert script.main(["--output", str(out), "--verify", "train"]) == 2
    assert "does not match" in one_error(capsys)
    (out / "train.json.gz").unlink()
    (root / "train.json.gz").write_bytes(gzip.compress(b'[{"question": "the source changed"}]'))
    assert script.main(["--output", str(out), "train"]) == 2
    assert "does not match the expected" in one_error(capsys)
    assert not (out / "train.json.gz").exists()


@pytest.mark.parametrize("entry", ["0" * 64, {"sha256": None, "size": 3}, {"sha256": "abc", "size": 3},
                                   {"sha256": "0" * 64, "size": "3"}, {"sha256": "0" * 64}, ["0" * 64, 3]])
def test_a_malformed_checksum_entry_is_refused_naming_the_file(tmp_path, monkeypatch, capsys, entry):
    """An entry of SHA256SUMS.json that is not ``{sha256: 64 hex digits, size: bytes}`` was an AttributeError
    traceback (a string) or skipped the check and was overwritten ({"sha256": null}); it is one error line naming
    the sums file and the entry, and the file is left as it was."""
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {"qa": ("http://127.0.0.1:9/qa.csv", "qa.csv", "", None)})
    out = tmp_path / "dpr"
    out.mkdir()
    (out / "qa.csv").write_bytes(b"q\t['a']\n")
    sums = json.dumps({"qa.csv": entry})
    (out / "SHA256SUMS.json").write_text(sums)
    assert script.main(["--output", str(out), "--verify", "qa"]) == 2
    assert one_error(capsys).startswith(f"error: {out / 'SHA256SUMS.json'}: the entry 'qa.csv' must be ")
    assert (out / "SHA256SUMS.json").read_text() == sums


def test_verify_says_gzip_intact_only_for_a_gzip_file(tmp_path, monkeypatch, capsys):
    """A .csv was reported 'gzip intact' though only .gz files are read through gzip."""
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {"qa": ("http://127.0.0.1:9/qa.csv", "qa.csv", "", None),
                                              "train": ("http://127.0.0.1:9/t.json.gz", "t.json.gz", "", None)})
    out = tmp_path / "dpr"
    out.mkdir()
    (out / "qa.csv").write_bytes(b"q\t['a']\n")
    (out / "t.json.gz").write_bytes(gzip.compress(b"[]"))
    assert script.main(["--output", str(out), "--verify", "qa", "train"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"qa: {out / 'qa.csv'} verified (sha256 recorded now)",
                       f"train: {out / 't.json.gz'} verified (gzip intact; sha256 recorded now)"]
    assert script.main(["--output", str(out), "--verify", "qa"]) == 0
    sha = hashlib.sha256(b"q\t['a']\n").hexdigest()
    assert capsys.readouterr().out == f"qa: {out / 'qa.csv'} verified (sha256 {sha})\n"


def test_an_output_folder_that_is_a_file_is_refused_naming_the_flag(tmp_path, capsys):
    """``--output_dir FILE`` was refused as "FILE is a file; give a folder", naming no flag."""
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    assert load_script("download_dpr_data").main(["--output_dir", str(taken), "nq-dev", "--dry-run"]) == 2
    assert one_error(capsys) == f"error: --output {taken} is a file; give a folder"
    assert taken.read_text() == "{}"


def test_verify_refuses_a_damaged_gzip_file_before_recording_its_checksum(tmp_path, monkeypatch, capsys):
    """``--verify`` promises the gzip CRCs are checked: a .gz file cut short, with no SHA-256 recorded yet, is one
    error line naming it, and no checksum of the damaged file is recorded for later runs to match."""
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {"train": ("http://127.0.0.1:9/t.json.gz", "t.json.gz", "", None)})
    out = tmp_path / "dpr"
    out.mkdir()
    whole = gzip.compress(b'[{"question": "q"}]' * 1000)
    (out / "t.json.gz").write_bytes(whole[:len(whole) // 2])
    assert script.main(["--output", str(out), "--verify", "train"]) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: {out / 't.json.gz'} is not an intact gzip file"), line
    assert not (out / "SHA256SUMS.json").exists()


def test_verify_of_a_file_not_downloaded_yet_says_to_download_it_first(tmp_path, monkeypatch, capsys):
    """``--verify`` of a resource whose file is not in the folder says so and what to run, in one line (not the
    system's bare "No such file or directory")."""
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {"qa": ("http://127.0.0.1:9/qa.csv", "qa.csv", "", None)})
    out = tmp_path / "dpr"
    out.mkdir()
    assert script.main(["--output", str(out), "--verify", "qa"]) == 2
    assert one_error(capsys) == f"error: {out / 'qa.csv'} is not downloaded yet; run without --verify first"


# DPR's download_data.py (facebookresearch/DPR, dpr/data/download_data.py, RESOURCES_MAP): the URL of each key
DPR_URLS = {
    "data.retriever.nq-train": "https://dl.fbaipublicfiles.com/dpr/data/retriever/biencoder-nq-train.json.gz",
    "data.retriever.nq-dev": "https://dl.fbaipublicfiles.com/dpr/data/retriever/biencoder-nq-dev.json.gz",
    "data.retriever.qas.nq-test": "https://dl.fbaipublicfiles.com/dpr/data/retriever/nq-test.qa.csv",
    "data.retriever.qas.nq-dev": "https://dl.fbaipublicfiles.com/dpr/data/retriever/nq-dev.qa.csv",
    "data.wikipedia_split.psgs_w100": "https://dl.fbaipublicfiles.com/dpr/wikipedia_split/psgs_w100.tsv.gz",
}


def test_each_dpr_key_downloads_the_url_dpr_lists_under_its_own_file_name():
    """The module docstring says the URLs are those of DPR's download_data.py and files stay gzipped where DPR
    publishes them gzipped: each --resource key fetches DPR's URL for that key, kept under the URL's file name."""
    script = load_script("download_dpr_data")
    assert set(script.DPR_KEYS) == set(DPR_URLS)
    for key, url in DPR_URLS.items():
        resource_url, filename, _, _ = script.RESOURCES[script.DPR_KEYS[key]]
        assert (resource_url, filename) == (url, url.rsplit("/", 1)[1]), key
    assert sorted(script.DPR_KEYS.values()) == sorted(script.RESOURCES)


def test_a_full_disk_while_downloading_says_to_free_space_not_to_check_the_network(server, tmp_path, monkeypatch,
                                                                                 capsys):
    """A disk that fills while a file downloads was reported as a network failure ("check the network
    connection"); it is one error line naming the file, saying the disk is full, and no partial file is left."""
    import errno

    root, url = server
    (root / "qa.csv").write_bytes(b"x" * 5000)
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {"qa": (f"{url}/qa.csv", "qa.csv", "", None)})

    class FullDisk:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def write(self, block: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(script, "open", FullDisk, raising=False)
    out = tmp_path / "dpr"
    out.mkdir()
    assert script.main(["--output", str(out), "qa"]) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: {out / 'qa.csv'}: the disk is full") and "network" not in line, line
    assert "free space" in line, line
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_second_download_into_a_folder_in_use_is_refused_at_once(server, tmp_path, monkeypatch, capsys):
    """Every stage and script holds its output folder's lock (guard.py): two downloads into one folder would write
    the same partial file and checksum record at once; the second is one error line and fetches nothing."""
    from dpr_gc.base.locks import exclusive_lock

    root, url = server
    (root / "qa.csv").write_bytes(b"q\t['a']\n")
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {"qa": (f"{url}/qa.csv", "qa.csv", "", None)})
    out = tmp_path / "dpr"
    out.mkdir()
    with exclusive_lock(out / ".dpr-gc.lock", "a first download"):  # what a running download holds
        assert script.main(["--output", str(out), "qa"]) == 2
        assert "in use by another run" in one_error(capsys)
        assert sorted(p.name for p in out.iterdir()) == [".dpr-gc.lock"]
