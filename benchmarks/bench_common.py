"""What the benchmark scripts share: where a results file goes by default (a smoke run never overwrites the
committed results of a full one)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def results_path(stem: str, smoke: bool) -> str:
    """The default results file ``benchmarks/results/STEM.json``, or ``STEM-quick.json`` for a smoke run
    (``--quick``, ``--tiny``): the committed results of a full run are never the target of a smoke run."""
    return str(RESULTS / f"{stem}{'-quick' if smoke else ''}.json")
