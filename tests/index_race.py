"""The two processes of ``test_index_readers_always_see_one_whole_build``: ``write`` rebuilds one index folder from
two embedding folders in turn, ``read`` loads it in a loop and checks that each load is one build (its metadata and
its vectors). Each prints a JSON summary and stops after the given seconds."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def write(out: str, seconds: float, *folders: str) -> dict:
    from dpr_gc.retrieval.index import IndexParams, build_index

    deadline, builds = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        build_index(folders[builds % len(folders)], out, IndexParams("flat"))
        builds += 1
    return {"builds": builds}


def read(out: str, seconds: float, expected_path: str) -> dict:
    """``expected``: the first vector of each build, by its row count."""
    import numpy as np

    from dpr_gc.base.errors import DprGcError
    from dpr_gc.retrieval.index import DenseIndex

    expected = json.loads(Path(expected_path).read_text())
    deadline, reads, seen, failures = time.monotonic() + seconds, 0, {}, []
    while time.monotonic() < deadline:
        reads += 1
        try:
            dense = DenseIndex.read(out)
        except DprGcError as e:
            failures.append(str(e))
            continue
        rows = str(dense.meta["corpus_rows"])
        if rows not in expected or not np.allclose(dense.index.reconstruct(0), expected[rows], atol=1e-6):
            failures.append(f"metadata of the {rows}-row build with the vectors of a {dense.ntotal}-row one")
        seen[rows] = seen.get(rows, 0) + 1
    return {"reads": reads, "seen": seen, "failed": len(failures), "failures": failures[:5]}


if __name__ == "__main__":
    role, out, seconds, *rest = sys.argv[1:]
    print(json.dumps((write if role == "write" else read)(out, float(seconds), *rest)))
