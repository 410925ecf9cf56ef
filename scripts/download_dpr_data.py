#!/usr/bin/env python
"""Download DPR's public Natural Questions files (training data with hard negatives, QA sets, Wikipedia passages).

    python scripts/download_dpr_data.py --output data/dpr nq-train nq-dev nq-test psgs_w100
    python scripts/download_dpr_data.py --output data/dpr --verify nq-test
    python scripts/download_dpr_data.py --list
    python scripts/download_dpr_data.py --resource data.retriever.nq-train --output_dir data/dpr  # DPR's form

Files are kept gzipped where DPR publishes them gzipped (every dpr-gc reader takes .gz). Each download goes to a
temporary file that is renamed only when complete and verified, so an interrupted or damaged download is never
mistaken for a finished one; finished files are skipped on the next run. DPR's ``download_data.py`` command line
runs too: ``--resource KEY`` takes DPR's key of each resource listed here (:data:`DPR_KEYS`) and ``--output_dir``
is ``--output``; the files keep the names listed, in the folder given.

Verification: DPR publishes no checksums for these files (its own download_data.py lists URLs only), so each
download is checked against what can be known: the size the server declares, the gzip CRC-32 and length of every
member for ``.gz`` files, and a SHA-256 where one is listed below. The SHA-256 and size of every finished file are
recorded in ``SHA256SUMS.json`` in the output folder; a later download into that folder, or ``--verify``, must match
them (so a file fetched again, or a copy, is checked against the first). An entry there that is not ``{"sha256": 64
hex digits, "size": bytes}`` stops the run with one line naming the file and the entry.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import socket
import sys
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpr_gc.base.args import ArgumentParser, RawDescriptionHelpFormatter, closest  # noqa: E402
from dpr_gc.base.errors import report_errors  # noqa: E402
from dpr_gc.base.errors import DiskFullError, DprGcError, is_disk_full  # noqa: E402
from dpr_gc.base.guard import guarded  # noqa: E402
from dpr_gc.cli import check_launch  # noqa: E402

BASE = "https://dl.fbaipublicfiles.com/dpr"
SUMS_FILE = "SHA256SUMS.json"
TIMEOUT_S = 60
# name: (url, file name, description, sha256 or None). The URLs are those of DPR's download_data.py.
RESOURCES = {
    "nq-train": (f"{BASE}/data/retriever/biencoder-nq-train.json.gz", "biencoder-nq-train.json.gz",
                 "NQ training questions with positive, negative and BM25 hard-negative passages (~2.4 GB gz)", None),
    "nq-dev": (f"{BASE}/data/retriever/biencoder-nq-dev.json.gz", "biencoder-nq-dev.json.gz",
               "NQ dev questions in the same format (for validation during training)", None),
    "nq-test": (f"{BASE}/data/retriever/nq-test.qa.csv", "nq-test.qa.csv",
                "NQ test questions and answers (DPR QA TSV: question<TAB>[answers])", None),
    "nq-dev-qa": (f"{BASE}/data/retriever/nq-dev.qa.csv", "nq-dev.qa.csv", "NQ dev questions and answers", None),
    "psgs_w100": (f"{BASE}/wikipedia_split/psgs_w100.tsv.gz", "psgs_w100.tsv.gz",
                  "21M Wikipedia passages of 100 words (id, text, title; ~4.7 GB gz)", None),
}

# DPR's download_data.py resource key -> the resource of :data:`RESOURCES` holding that file.
DPR_KEYS = {"data.retriever.nq-train": "nq-train", "data.retriever.nq-dev": "nq-dev",
            "data.retriever.qas.nq-test": "nq-test", "data.retriever.qas.nq-dev": "nq-dev-qa",
            "data.wikipedia_split.psgs_w100": "psgs_w100"}


def dpr_resources(parser: ArgumentParser, keys: list[str]) -> list[str]:
    """The resources DPR's ``--resource`` keys name; a key not in :data:`DPR_KEYS` is refused in one line naming
    ``--resource`` and the closest key."""
    for key in keys:
        if key not in DPR_KEYS:
            close = closest(key, DPR_KEYS)
            parser.error(f"--resource {key} is no DPR resource this script downloads; choose from "
                         f"{', '.join(DPR_KEYS)}" + (f"; did you mean {close}?" if close else ""))
    return [DPR_KEYS[key] for key in keys]


def build_parser() -> ArgumentParser:
    """The script's command line (its ``--help`` keeps the examples above line by line)."""
    parser = ArgumentParser(prog="download_dpr_data.py", description=__doc__,
                            formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("resources", nargs="*", help=f"any of: {', '.join(RESOURCES)}")
    parser.add_argument("--resource", dest="dpr_keys", action="append", default=[], metavar="KEY",
                        help=f"a resource by DPR's download_data.py key, any of: {', '.join(DPR_KEYS)}")
    parser.add_argument("--output", "--output_dir", default="data/dpr", help="download folder")
    parser.add_argument("--list", action="store_true", help="list the resources and exit")
    parser.add_argument("--dry-run", action="store_true", help="print what would be downloaded, download nothing")
    parser.add_argument("--verify", action="store_true",
                        help="check files already downloaded against the recorded SHA-256 (and gzip CRCs)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.resources += dpr_resources(parser, args.dpr_keys)
    unknown = [r for r in args.resources if r not in RESOURCES]
    if unknown:
        close = closest(unknown[0], RESOURCES)
        parser.error(f"unknown resource {', '.join(unknown)}; choose from {', '.join(RESOURCES)}"
                     + (f"; did you mean {close}?" if close else ""))
    if not args.resources and not args.list:
        parser.error("name at least one resource (or --list)")
    return args


def fetch(url: str, tmp: Path, target: Path) -> tuple[str, int]:
    """Stream ``url`` into ``tmp`` (the download of ``target``); returns its SHA-256 and size. Network failures, a
    short body and a full disk (named as ``target``, not as the network's fault) raise one line."""
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(tmp, "wb") as f:
            declared = response.headers.get("Content-Length")
            while block := response.read(1 << 20):
                digest.update(block)
                f.write(block)
                size += len(block)
    except urllib.error.HTTPError as e:
        raise DprGcError(f"cannot download {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as e:
        if is_disk_full(e):
            raise DiskFullError(target) from None
        reason = getattr(e, "reason", None) or e
        raise DprGcError(f"cannot download {url}: {reason}; check the network connection (or fetch the file "
                         f"by hand into {tmp.parent})") from None
    if declared is not None and int(declared) != size:
        raise DprGcError(f"download of {url} is incomplete ({size} of {declared} bytes); run the command again")
    return digest.hexdigest(), size


def check_gzip(path: Path, label: str) -> None:
    """Read a gzip file to the end: every member's CRC-32 and length are checked on the way."""
    try:
        with gzip.open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    except (OSError, EOFError, zlib.error) as e:
        raise DprGcError(f"{label} is not an intact gzip file ({e}); delete it and download it again") from None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def read_sums(folder: Path) -> dict:
    """The checksums recorded in ``folder``'s :data:`SUMS_FILE` (none when it is absent), each entry checked: one
    that is not ``{"sha256": 64 hex digits, "size": bytes}`` would skip the check or stop in a traceback."""
    path = folder / SUMS_FILE
    if not path.is_file():
        return {}
    try:
        sums = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DprGcError(f"{path}: invalid JSON ({e}); delete it to record the checksums again") from None
    if not isinstance(sums, dict):
        raise DprGcError(f"{path}: expected an object of file name -> {{sha256, size}}; delete it")
    for filename, entry in sums.items():
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        size = entry.get("size") if isinstance(entry, dict) else None
        if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)) or isinstance(size, bool) \
                or not isinstance(size, int) or size < 0:
            raise DprGcError(f"{path}: the entry {filename!r} must be {{\"sha256\": 64 lowercase hex digits, "
                             f"\"size\": bytes}}, got {json.dumps(entry)[:80]}; fix it, or delete the entry to "
                             "record it again")
    return sums


def write_sums(folder: Path, sums: dict) -> None:
    tmp = folder / f".{SUMS_FILE}.tmp"
    tmp.write_text(json.dumps(sums, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, folder / SUMS_FILE)


def expected_sha256(name: str, filename: str, sums: dict) -> Optional[str]:
    """The SHA-256 a file must have: the published one when listed, else the one recorded at its first download."""
    published = RESOURCES[name][3]
    return published or (sums.get(filename) or {}).get("sha256")


def download(name: str, out: Path, sums: dict) -> None:
    url, filename, _, _ = RESOURCES[name]
    target, tmp = out / filename, out / f".{filename}.part"
    try:
        sha, size = fetch(url, tmp, target)
        if filename.endswith(".gz"):
            check_gzip(tmp, f"the download of {url}")
        want = expected_sha256(name, filename, sums)
        if want and want != sha:
            raise DprGcError(f"{url}: SHA-256 {sha} does not match the expected {want}; the file was not kept "
                             f"(if the source changed on purpose, remove its entry from {out / SUMS_FILE})")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    sums[filename] = {"sha256": sha, "size": size, "url": url}
    write_sums(out, sums)
    print(f"{name}: {target} ({size} bytes, sha256 {sha})")


def verify(name: str, out: Path, sums: dict) -> None:
    _, filename, _, _ = RESOURCES[name]
    target = out / filename
    if not target.is_file():
        raise DprGcError(f"{target} is not downloaded yet; run without --verify first")
    want, sha = expected_sha256(name, filename, sums), file_sha256(target)
    if filename.endswith(".gz"):
        check_gzip(target, str(target))
    if want and want != sha:
        raise DprGcError(f"{target}: SHA-256 {sha} does not match the expected {want}; delete it and download again")
    if not want:
        sums[filename] = {"sha256": sha, "size": target.stat().st_size, "url": RESOURCES[name][0]}
        write_sums(out, sums)
    checked = "gzip intact; " if filename.endswith(".gz") else ""
    print(f"{name}: {target} verified ({'sha256 ' + sha if want else checked + 'sha256 recorded now'})")


@guarded(outputs={"output": "folder"})
def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, (_, filename, what, _) in RESOURCES.items():
            print(f"{name:10s} {filename:32s} {what}")
        return 0
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise DprGcError(f"--output {out} is a file; give a folder")
    sums = read_sums(out)
    for name in args.resources:
        url, filename, _, _ = RESOURCES[name]
        target = out / filename
        if args.verify:
            verify(name, out, sums)
        elif target.is_file():
            print(f"{name}: {target} already there (check it with --verify)")
        elif args.dry_run:
            print(f"{name}: {url} -> {target}")
        else:
            print(f"{name}: {url} -> {target}")
            out.mkdir(parents=True, exist_ok=True)
            download(name, out, sums)
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def run_once() -> int:
        check_launch("", program="download_dpr_data.py")  # under torchrun every rank would download every file
        return run(args)
    return report_errors(run_once)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
