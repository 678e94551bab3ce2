"""Operator test fixtures: the real control plane (tests/conftest_k8s.py) and a running operator."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Helper modules next to these tests (crd_schema.py) import by name, like tests/conftest.py arranges for tests/;
# so do the controller's (promserver.py, fake_engine.py) for test_controller_k8s.py.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1] / "controller"))

from conftest_k8s import K8sEnv, OperatorProcess, crd, k8s, namespace  # noqa: F401  (fixtures)


@pytest.fixture(scope="session")
def operator_all(k8s: K8sEnv, crd: dict) -> Iterator[OperatorProcess]:  # noqa: F811
    """One operator for the session, watching the namespaces tests create (t<N>-...)."""
    op = OperatorProcess(k8s, "--namespace", "t*")
    yield op
    op.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that ran against the session's operator carries the tail of the operator's log, so a
    failure seen only in CI says what the operator was doing (the log file is gone with the machine)."""
    report = yield
    operator = getattr(item, "funcargs", {}).get("operator_all")
    if report.failed and isinstance(operator, OperatorProcess):
        report.sections.append(("stallfree operator log (last 80 lines)", operator.log_tail()))
    return report
