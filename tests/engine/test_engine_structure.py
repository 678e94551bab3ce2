"""Issue 28's structure rules for the engine, as cheap static checks (STYLE.md habit 11).

- Code outside the attention registry does not branch on an attention backend's name: it asks the backend
  (its kernels, graph support, sampling). At most MAX_NAME_BRANCHES comparisons with a backend name remain.
- One metadata builder: only stallfree.engine.attention.batch turns block tables into KV-cache slots.
- One execute loop: only stallfree.engine.model_runner defines a runner's `execute` (the parallel executor's
  `execute` only hands a step to the workers and collects it); the parallel worker runs that runner.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).parents[2]
ENGINE = REPO / "engine"
BACKEND_NAMES = {"torch", "cpu", "triton", "flashinfer"}
REGISTRY = ENGINE / "attention" / "registry.py"
MAX_NAME_BRANCHES = 3


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _names_in(node: ast.AST) -> set[str]:
    """Backend names a comparison operand spells out: a string, or a tuple / list / set of strings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & BACKEND_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def backend_name_branches(path: Path) -> list[str]:
    """Comparisons with a backend name. "cpu" (also a device, a clock, a host field) counts only where the
    other side speaks of a backend or attention."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = set().union(*(_names_in(o) for o in operands))
        other = " ".join(ast.unparse(o) for o in operands if not _names_in(o)).lower()
        if names - {"cpu"} or (names and ("backend" in other or "attention" in other)):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_backend_name_branches_live_in_the_registry() -> None:
    found = [
        b for p in _sources(ENGINE, REPO / "stallfree") if p != REGISTRY for b in backend_name_branches(p)
    ]
    assert len(found) <= MAX_NAME_BRANCHES, (
        "branches on a backend's name outside the registry:\n" + "\n".join(found)
    )


def test_the_counter_sees_a_branch_and_ignores_device_types(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "if name == 'triton' or backend in ('cpu', 'x'):\n    pass\n"
        "if device.type == 'cpu' or clock == 'cpu':\n    pass\n"
        "if mode == 'fast':\n    pass\n"
    )
    found = backend_name_branches(probe)
    assert len(found) == 2 and all(":1:" in f for f in found), found


def test_one_metadata_builder() -> None:
    """Only the common batch reads the scheduler's block tables (the slot arithmetic); the scheduler and
    block manager, which make them, are not builders."""
    makers = {ENGINE / "scheduler.py", ENGINE / "block_manager.py"}
    readers = sorted(
        str(p.relative_to(REPO))
        for p in _sources(ENGINE)
        if p not in makers
        and any(
            isinstance(n, ast.Attribute) and n.attr == "block_table"
            for n in ast.walk(ast.parse(p.read_text()))
        )
    )
    assert readers == ["engine/attention/batch.py"], readers


def test_one_execute_loop() -> None:
    dispatch = ENGINE / "parallel" / "executor.py"  # submit to the worker ranks, collect: no forward
    defs = sorted(
        f"{p.relative_to(REPO)}:{n.lineno}"
        for p in _sources(ENGINE)
        if p != dispatch
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "execute"
    )
    assert len(defs) == 1 and defs[0].startswith("engine/model_runner.py:"), defs
    worker = (ENGINE / "parallel" / "worker.py").read_text()
    assert "ModelRunner(" in worker, "the parallel worker must run the one ModelRunner"


def test_the_model_gets_its_kernels_from_its_caller() -> None:
    """No runner sets attributes on the model: its kernels come in as an argument."""
    setters = [
        f"{p.relative_to(REPO)}:{n.lineno}: {ast.unparse(n)}"
        for p in _sources(ENGINE)
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and t.attr == "kernels"
    ]
    assert not setters, setters
