#!/usr/bin/env python
"""Download DPR's public Natural Questions files (training data with hard negatives, QA sets, Wikipedia passages).

    python scripts/download_dpr_data.py --output data/dpr nq-train nq-dev nq-test psgs_w100
    python scripts/download_dpr_data.py --list

Files are kept gzipped where DPR publishes them gzipped (every dpr-gc reader takes .gz). Each download goes to a
temporary file that is renamed only when complete, so an interrupted download is never mistaken for a finished one;
finished files are skipped on the next run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import urllib.request
from pathlib import Path

BASE = "https://dl.fbaipublicfiles.com/dpr"
RESOURCES = {
    "nq-train": (f"{BASE}/data/retriever/biencoder-nq-train.json.gz", "biencoder-nq-train.json.gz",
                 "NQ training questions with positive, negative and BM25 hard-negative passages (~2.4 GB gz)"),
    "nq-dev": (f"{BASE}/data/retriever/biencoder-nq-dev.json.gz", "biencoder-nq-dev.json.gz",
               "NQ dev questions in the same format (for validation during training)"),
    "nq-test": (f"{BASE}/data/retriever/qas/nq-test.csv", "nq-test.qa.csv",
                "NQ test questions and answers (DPR QA TSV: question<TAB>[answers])"),
    "nq-dev-qa": (f"{BASE}/data/retriever/qas/nq-dev.csv", "nq-dev.qa.csv", "NQ dev questions and answers"),
    "psgs_w100": (f"{BASE}/wikipedia_split/psgs_w100.tsv.gz", "psgs_w100.tsv.gz",
                  "21M Wikipedia passages of 100 words (id, text, title; ~4.7 GB gz)"),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("resources", nargs="*", help=f"any of: {', '.join(RESOURCES)}")
    parser.add_argument("--output", default="data/dpr", help="download folder")
    parser.add_argument("--list", action="store_true", help="list the resources and exit")
    parser.add_argument("--dry-run", action="store_true", help="print what would be downloaded, download nothing")
    args = parser.parse_args(argv)
    unknown = [r for r in args.resources if r not in RESOURCES]
    if unknown:
        parser.error(f"unknown resource {', '.join(unknown)}; choose from {', '.join(RESOURCES)}")
    if not args.resources and not args.list:
        parser.error("name at least one resource (or --list)")
    return args


def download(url: str, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.part")
    with urllib.request.urlopen(url) as response, open(tmp, "wb") as f:
        shutil.copyfileobj(response, f, length=1 << 20)
    tmp.replace(target)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.list:
        for name, (_, filename, what) in RESOURCES.items():
            print(f"{name:10s} {filename:32s} {what}")
        return 0
    out = Path(args.output)
    for name in args.resources:
        url, filename, _ = RESOURCES[name]
        target = out / filename
        if target.is_file():
            print(f"{name}: {target} already there")
            continue
        print(f"{name}: {url} -> {target}")
        if not args.dry_run:
            out.mkdir(parents=True, exist_ok=True)
            download(url, target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
