"""The public API's docstrings: every example in them runs, the main entry points have one, and the references
they name hold.

The examples build tiny models in place or load the offline all-MiniLM-L6-v2 (a dependency); nothing is downloaded.
Docstrings are read from the source (``ast``), so checking them imports nothing; the JAX modules' examples run in a
child process, since JAX's thread pools would stay up for the rest of this one (see conftest.py).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import io
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import dpr_gc
from dpr_gc import SimpleContrastiveLoss

ROOT = Path(__file__).resolve().parents[1]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# the modules that define the public API: dpr_gc's names, the engine (the GradCache drop-in) and dpr_gc.jax
TORCH_MODULES = sorted({"dpr_gc", "dpr_gc.engine", "dpr_gc.engine.grad_cache", "dpr_gc.engine.chunking",
                        "dpr_gc.engine.loss", "dpr_gc.engine.functional"}
                       | {f"dpr_gc.{module}" for module in dpr_gc._EXPORTS.values()})
JAX_MODULES = ["dpr_gc.jax", "dpr_gc.jax.grad_cache", "dpr_gc.jax.loss", "dpr_gc.jax.model", "dpr_gc.jax.parallel"]
# (module, qualified name): the entry points a user starts from, each with a runnable example and its reference
ENTRY_POINTS = [("dpr_gc.engine.grad_cache", "GradCache"), ("dpr_gc.engine.loss", "SimpleContrastiveLoss"),
                ("dpr_gc.engine.loss", "DistributedContrastiveLoss"), ("dpr_gc.engine.loss", "Temperature"),
                ("dpr_gc.engine.functional", "cached"), ("dpr_gc.engine.functional", "cat_input_tensor"),
                ("dpr_gc.engine.functional", "gather_input_tensor"), ("dpr_gc.model.retriever", "Retriever.load"),
                ("dpr_gc.model.retriever", "Retriever.embed"), ("dpr_gc.train.trainer", "Trainer"),
                ("dpr_gc.jax.loss", "ContrastiveLoss"), ("dpr_gc.jax.grad_cache", "cached_value_and_grad")]
REFERENCES = ("Gao et al. 2021", "Karpukhin et al. 2020", "luyug/GradCache", "sentence-transformers",
              "Radford et al. 2021")


def module_file(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def docstrings(module: str) -> dict[str, str]:
    """Every docstring of ``module`` by qualified name ("" for the module's own), read from its source."""
    tree = ast.parse(module_file(module).read_text())
    found = {"": ast.get_docstring(tree) or ""}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found[prefix + child.name] = ast.get_docstring(child) or ""
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def public(qualname: str) -> bool:
    return not any(part.startswith("_") for part in qualname.split("."))


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The examples' temporary folders and caches go to ``tmp_path``, not to the user's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("DPR_GC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("module", TORCH_MODULES)
def test_the_examples_in_the_public_docstrings_run(module: str, sandbox: Path) -> None:
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    for test in doctest.DocTestFinder().find(importlib.import_module(module)):
        runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()
    written = sum(line.lstrip().startswith(">>>") for doc in docstrings(module).values() for line in doc.splitlines())
    assert runner.tries == written, f"{module}: {written} examples written, {runner.tries} run"


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="the JAX extra is not installed")
def test_the_examples_in_the_jax_docstrings_run(sandbox: Path) -> None:
    code = ("import doctest, importlib, sys\n"
            "failed = sum(doctest.testmod(importlib.import_module(m), optionflags=doctest.ELLIPSIS | "
            "doctest.NORMALIZE_WHITESPACE).failed for m in sys.argv[1:])\n"
            "sys.exit(1 if failed else 0)\n")
    done = subprocess.run([sys.executable, "-c", code, *JAX_MODULES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("module", TORCH_MODULES + JAX_MODULES)
def test_every_code_example_in_a_public_docstring_is_a_doctest(module: str) -> None:
    """A literal block (``::``) or an ``Example`` section holds ``>>>`` lines, so the test above runs it."""
    for qualname, doc in docstrings(module).items():
        if not public(qualname):
            continue
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            if line.rstrip().endswith("::") or line.strip().startswith("Example"):
                following = next((rest.strip() for rest in lines[i + 1:] if rest.strip()), "")
                assert following.startswith(">>>"), f"{module}.{qualname or '(module)'}: {line.strip()!r} " \
                                                     f"is followed by {following!r}, not a doctest"


@pytest.mark.parametrize("module,qualname", ENTRY_POINTS)
def test_the_main_entry_points_have_an_example_and_a_reference(module: str, qualname: str) -> None:
    doc = docstrings(module)[qualname]
    assert ">>>" in doc, f"{qualname} has no runnable example"
    assert any(reference in doc for reference in REFERENCES), f"{qualname} names no reference it follows"


@pytest.mark.parametrize("n_hard,symmetric", [(0, False), (2, False), (1, True)])
def test_simple_contrastive_loss_is_sentence_transformers_multiple_negatives_ranking_loss(n_hard: int,
                                                                                        symmetric: bool) -> None:
    """SimpleContrastiveLoss's References: ``similarity="cos"`` at ``temperature=1/scale`` is sentence-transformers'
    MultipleNegativesRankingLoss (``symmetric``: its query_to_doc + doc_to_query directions, per direction), in
    value and gradient; sentence-transformers takes the passages as columns (positives, then each negative)."""
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    theirs = MultipleNegativesRankingLoss(None, scale=20.0, directions=directions, partition_mode="per_direction")
    ours = SimpleContrastiveLoss(n_hard, temperature=0.05, similarity="cos", symmetric=symmetric)
    torch.manual_seed(0)
    queries = torch.randn(6, 16, dtype=torch.float64)
    columns = torch.randn(1 + n_hard, 6, 16, dtype=torch.float64)  # column j: every query's passage j
    results = []
    for loss in (lambda x, y: ours(x, y.transpose(0, 1).reshape(-1, 16)),
                 lambda x, y: theirs.compute_loss_from_embeddings([x, *y], None)):
        x, y = queries.clone().requires_grad_(), columns.clone().requires_grad_()
        value = loss(x, y)
        value.backward()
        results.append((value.item(), x.grad, y.grad))
    (ours_value, ours_dx, ours_dy), (their_value, their_dx, their_dy) = results
    assert ours_value == pytest.approx(their_value, rel=1e-5)
    assert torch.allclose(ours_dx.double(), their_dx, rtol=1e-4, atol=1e-7)
    assert torch.allclose(ours_dy.double(), their_dy, rtol=1e-4, atol=1e-7)
