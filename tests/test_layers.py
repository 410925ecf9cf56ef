"""The package's layers, checked from the source: lower layers never import higher ones, and no module imports
itself back through others -- counting imports inside functions, which run as surely as the ones at the top.

Layers, low to high: base < engine < model < data < evaluation < retrieval < train < the top (cli, pipeline, the
package ``__init__`` and ``__main__``). ``dpr_gc.jax`` is an optional side package: it may use every layer but the
top, and nothing else imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Optional

PACKAGE = Path(__file__).resolve().parents[1] / "dpr_gc"
LAYERS = ("base", "engine", "model", "data", "evaluation", "retrieval", "train")
TOP = len(LAYERS) + 1
SIDE = {"jax": TOP - 0.5}  # above every layer, below the top


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """``dpr_gc.x.y`` -> source file, for every module of the package (a package by its ``__init__``)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = (package.name,) + path.relative_to(package).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (top level, functions, methods)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" for alias in node.names] + [origin]
        for target in targets:
            module = _owning_module(target, modules)
            if module is not None and module != name:
                found.add(module)
    return found


def _owning_module(target: str, modules: dict[str, Path]) -> Optional[str]:
    """``target`` itself when it is a module of the package, else the module it names something in."""
    if target in modules:
        return target
    parent = target.rpartition(".")[0]
    return parent if parent in modules and not _is_package(parent, modules) else None


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> float:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS and parts[1] not in SIDE:
        return TOP  # cli, pipeline, __main__ and the package __init__
    return SIDE.get(parts[1], LAYERS.index(parts[1]) if parts[1] in LAYERS else TOP)


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer (or of the side package from outside it) as ``importer -> imported``."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            into_side = target.split(".")[1:2] and target.split(".")[1] in SIDE
            from_side = module.split(".")[1:2] and module.split(".")[1] in SIDE
            if layer_of(target) > layer_of(module) or (into_side and not from_side and layer_of(module) < TOP):
                bad.append(f"{module} -> {target}")
    return bad


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import cycle as a list of modules (first == last), or None when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> Optional[list[str]]:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_layer_imports_a_higher_one() -> None:
    bad = upward_edges(import_graph())
    assert not bad, "imports of a higher layer (order: " + " < ".join(LAYERS) + " < top):\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_model_modules_import_only_earlier_steps() -> None:
    """``dpr_gc.model``'s docstring numbers its modules in steps; each imports only modules of earlier steps, and the
    steps name every module of the package."""
    import re

    doc = (PACKAGE / "model" / "__init__.py").read_text(encoding="utf-8")
    listed = [(name, int(number)) for number, names in re.findall(r"^(\d+)\. (.*?) --", doc, re.M)
              for name in re.findall(r"``(\w+)``", names)]
    step = dict(listed)
    assert len(step) == len(listed), "a module listed in two steps"
    ours = {m.rsplit(".", 1)[1]: targets for m, targets in import_graph().items() if m.startswith("dpr_gc.model.")}
    assert set(step) == set(ours), set(step) ^ set(ours)
    late = [f"{m} -> {t.rsplit('.', 1)[1]}" for m, targets in ours.items() for t in targets
            if t.startswith("dpr_gc.model.") and step[t.rsplit(".", 1)[1]] >= step[m]]
    assert not late, late


def test_the_checks_see_imports_inside_functions(tmp_path: Path) -> None:
    """The checks themselves: a function-level import closing a circle, and a low layer importing a high one
    from inside a function, are both caught and named."""
    package = tmp_path / "dpr_gc"
    for sub in ("base", "model", "train"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text('"""layer"""\n')
    (package / "__init__.py").write_text("")
    (package / "model" / "a.py").write_text("from .b import thing\n")
    (package / "model" / "b.py").write_text("def thing():\n    from . import a\n    return a\n")
    (package / "base" / "low.py").write_text("def f():\n    from ..train.high import g\n    return g\n")
    (package / "train" / "high.py").write_text("def g():\n    return 1\n")
    graph = import_graph(package)
    assert upward_edges(graph) == ["dpr_gc.base.low -> dpr_gc.train.high"]
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) >= {"dpr_gc.model.a", "dpr_gc.model.b"}


def test_test_files_share_helpers_not_each_other() -> None:
    """Test files take shared builders from the helper modules (helpers, train_data, llm_models, ranks), never from
    another test file or from conftest (fixtures reach tests through pytest)."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                leaf = name.split(".")[-1]
                if name.startswith("tests.") and (leaf.startswith("test_") or leaf == "conftest") and \
                        leaf != path.stem:
                    bad.append(f"{path.name}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)


def test_engine_imports_alone() -> None:
    """The drop-in stays usable without the rest: importing dpr_gc.engine loads no retriever, data or training."""
    code = ("import sys, dpr_gc.engine.grad_cache, dpr_gc.engine.loss, dpr_gc.engine.functional; "
            "bad = [m for m in sys.modules if m.startswith('dpr_gc.') and m.split('.')[1] not in ('engine', 'base')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
