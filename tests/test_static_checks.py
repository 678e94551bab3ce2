"""House style as tests: ruff lint and format over the repo and mypy over the typed core (STYLE.md, habit 7),
and which way the layers point (habit 9: production code never imports benchmark code).

The tools run from the venv running pytest, from the repo root, so pyproject.toml's settings apply.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
# The paths STYLE.md keeps under mypy: scheduler, block manager, server and operator, and the cost model the
# operator's controller plans with, and the SLO type the engine, operator and controller share.
MYPY_PATHS = [
    "engine/scheduler.py",
    "engine/block_manager.py",
    "engine/server",
    "operator",
    "stallfree/costmodel",
    "stallfree/slo.py",
]
# folder -> packages nothing in it may import. The operator is what runs in a cluster: benchmark harnesses
# and local mode live outside it. The engine serves: benchmarks drive it from outside (habit 9). The cost
# model is shared by the profiler, the simulator and the controller, so it imports none of them. Nothing
# in the product imports the experiments (habit 12): they are not even in the installed package.
FORBIDDEN_IMPORTS = {
    "operator": ("stallfree.bench", "stallfree.local", "experiments"),
    "engine": ("stallfree.bench", "stallfree.local", "experiments"),
    "stallfree": ("experiments",),
    "stallfree/costmodel": ("stallfree.bench", "stallfree.local", "stallfree.operator"),
}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_ruff_check_passes() -> None:
    proc = _run("ruff", "check", ".")
    assert proc.returncode == 0, f"ruff check failed:\n{proc.stdout}{proc.stderr}"


def test_ruff_format_is_clean() -> None:
    proc = _run("ruff", "format", "--check", ".")
    assert proc.returncode == 0, (
        f"ruff format would change files (run `ruff format .`):\n{proc.stdout}{proc.stderr}"
    )


def test_mypy_passes_on_typed_paths() -> None:
    proc = _run("mypy", *MYPY_PATHS)
    assert proc.returncode == 0, f"mypy failed:\n{proc.stdout}{proc.stderr}"


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in a file, at any depth (lazy imports inside functions too)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            # `from stallfree import bench` imports stallfree.bench as well
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)


def forbidden(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN_IMPORTS))
def test_layers_point_one_way(folder: str) -> None:
    packages = FORBIDDEN_IMPORTS[folder]
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, module in imported_modules(path)
        if forbidden(module, packages)
    ]
    assert not found, f"{folder}/ must not import {' or '.join(packages)}:\n" + "\n".join(found)


def test_the_import_check_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from stallfree import local\n\ndef f():\n    import stallfree.bench.traces\n")
    mods = [m for _, m in imported_modules(src)]
    assert forbidden("stallfree.bench.traces", ("stallfree.bench",))
    assert not forbidden("stallfree.benchmarks", ("stallfree.bench",))
    assert forbidden("experiments.phase.sim", ("experiments",))
    assert not forbidden("experimental", ("experiments",))
    assert "stallfree.local" in mods and "stallfree.bench.traces" in mods


def _setup_py():
    """setup.py as a module: its roots and what it discovers (its setup() call only runs as __main__)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stallfree_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_code_folder_is_packaged_and_the_experiments_are_not() -> None:
    """What setup.py discovers: no experiments, no tests, and every folder of code under a root (one without
    an __init__.py would import from a checkout but be left out of the wheel). tests/test_packaging.py
    builds and installs it."""
    setup = _setup_py()
    packaged = setup.discover()
    assert not [p for p in packaged if forbidden(p, ("experiments", "tests"))], packaged
    assert {"stallfree.engine.attention", "stallfree.engine.server.tool_calls"} <= set(packaged)
    for name, folder in setup.ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            package = ".".join((name, *path.parent.relative_to(REPO / folder).parts))
            assert package in packaged, f"{path.parent.relative_to(REPO)}/ holds code but no __init__.py"
