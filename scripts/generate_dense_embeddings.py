"""Embed a passage corpus into shards: ``dpr-gc encode`` under DPR's script name, accepting DPR's flag names.

Both spellings work, and so does DPR's Hydra ``key=value`` style::

    python scripts/generate_dense_embeddings.py --model out/retriever --corpus psgs_w100.tsv --output emb/
    python scripts/generate_dense_embeddings.py model_file=out/retriever ctx_file=psgs_w100.tsv \
        shard_id=0 num_shards=50 out_file=emb/ batch_size=512

Unlike DPR, ``--ctx_src``/``--ctx_file`` is a corpus file (not a named source) and ``--out_file`` is an output
folder that receives ``shard-K-of-N.npy``, ``.ids.txt`` and the ``.json`` manifest.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpr_gc.encode import add_arguments, run_cli  # noqa: E402
from dpr_gc.args import ArgumentParser  # noqa: E402
from dpr_gc.cli import report_errors  # noqa: E402

HYDRA_ARG = re.compile(r"^([A-Za-z_][\w.-]*)=(.*)$")


def hydra_to_flags(argv: Sequence[str]) -> list[str]:
    """Turn DPR's ``key=value`` arguments into ``--key value``; other arguments pass through."""
    out: list[str] = []
    for arg in argv:
        m = HYDRA_ARG.match(arg)
        out.extend([f"--{m.group(1)}", m.group(2)] if m and not arg.startswith("-") else [arg])
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, dpr_aliases=True)
    args = parser.parse_args(hydra_to_flags(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return report_errors(lambda: run_cli(args))


if __name__ == "__main__":
    sys.exit(main())
