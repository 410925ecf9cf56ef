"""Every ```python block of the README and docs/library.md runs as printed: the names a block leaves to the reader
(an encoder, its batches, an optimizer) are given tiny ones built in code, and the hub names and paths it shows are
swapped for tiny ones by the small explicit table :data:`SUBSTITUTIONS`. A block that is neither run here nor listed
in :data:`RUN_ELSEWHERE` with the test that runs it fails, so a new snippet cannot go untested."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "library.md"]
# What a block shows -> what runs in its place (each must appear in the block it is written for).
SUBSTITUTIONS = {
    "trainer": {'"bert-base-uncased"': "MODEL", '"data/dpr/biencoder-nq-train.json.gz"': "TRAIN",
                "batch_size=128": "batch_size=4", "epochs=40": "epochs=1", "warmup_steps=1237": "warmup_steps=1",
                "query_chunk_size=32, passage_chunk_size=32": "query_chunk_size=2, passage_chunk_size=4",
                '"runs/nq"': "OUTPUT"},
}
# Blocks another test runs as printed: a line only they hold -> that test.
RUN_ELSEWHERE = {
    "model = SentenceTransformer(str(folder))":
        "tests/test_model_io.py::test_the_library_pages_sentence_transformers_snippet_embeds_as_dpr_gc_encode",
}


def python_blocks() -> list[tuple[str, str]]:
    """``(page:line, code)`` of each python block of :data:`PAGES`."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            blocks.append((f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return blocks


def substituted(code: str, kind: str, values: dict[str, str]) -> str:
    """``code`` with :data:`SUBSTITUTIONS` of ``kind`` made, placeholders (``MODEL``) taken from ``values``."""
    for shown, instead in SUBSTITUTIONS[kind].items():
        assert shown in code, f"{shown} is no longer in the {kind} block; update SUBSTITUTIONS"
        code = code.replace(shown, repr(values[instead]) if instead in values else instead)
    return code


def run_grad_cache(code: str, tmp_path: Path, trained: dict) -> None:
    """The GradCache snippet with a tiny encoder, its batches (B queries, B*(1+1) passages) and an optimizer: its
    loss is the full batch's and the step moves the encoder's weights."""
    from dpr_gc import SimpleContrastiveLoss

    torch.manual_seed(0)
    encoder = torch.nn.Linear(8, 4)
    names: dict[str, Any] = {"encoder": encoder, "query_batch": torch.randn(6, 8), "passage_batch": torch.randn(12, 8),
                             "optimizer": torch.optim.SGD(encoder.parameters(), lr=0.1)}
    before = encoder.weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = SimpleContrastiveLoss(n_hard_negatives=1, temperature=0.05, similarity="cos")(
            encoder(names["query_batch"]), encoder(names["passage_batch"]))
    exec(code, names)
    assert float(names["loss"]) == pytest.approx(float(full.detach()), rel=1e-2)
    assert not torch.equal(encoder.weight, before)


def run_trainer(code: str, tmp_path: Path, trained: dict) -> None:
    """The trainer snippet on the tiny run's model and training file, into a folder of the test's."""
    values = {"MODEL": str(trained["model"]), "TRAIN": str(trained["train"]), "OUTPUT": str(tmp_path / "run")}
    names: dict[str, Any] = {}
    exec(substituted(code, "trainer", values), names)
    assert (tmp_path / "run" / "final").is_dir() and names["summary"]


# A line only that block holds -> how it runs.
RUNNERS: dict[str, Callable[[str, Path, dict], None]] = {
    "gc = GradCache(models=[encoder, encoder]": run_grad_cache,
    "summary = Trainer(config).fit()": run_trainer,
}


def which(code: str) -> list[str]:
    return [key for key in (*RUNNERS, *RUN_ELSEWHERE) if key in code]


def test_every_python_block_is_run_here_or_listed_with_the_test_that_runs_it() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 4, blocks
    unknown = [where for where, code in blocks if len(which(code)) != 1]
    assert not unknown, f"python blocks neither run here nor listed in RUN_ELSEWHERE (or matched twice): {unknown}"
    for key, test in RUN_ELSEWHERE.items():
        path, _, name = test.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{test} (listed for {key!r}) is gone"


@pytest.mark.parametrize("where", [where for where, code in python_blocks() if set(which(code)) & set(RUNNERS)])
def test_the_python_block_runs_as_printed(where: str, tmp_path: Path, trained: dict, monkeypatch) -> None:
    code = dict(python_blocks())[where]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPR_GC_CACHE", str(tmp_path / "cache"))
    RUNNERS[which(code)[0]](code, tmp_path, trained)
