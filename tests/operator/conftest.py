"""Operator test fixtures: the real control plane (tests/conftest_k8s.py) and a running operator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest_k8s import K8sEnv, OperatorProcess, crd, k8s, namespace  # noqa: F401  (fixtures)


@pytest.fixture(scope="session")
def operator_all(k8s: K8sEnv, crd: dict) -> Iterator[OperatorProcess]:  # noqa: F811
    """One operator for the session, watching the namespaces tests create (t<N>-...)."""
    op = OperatorProcess(k8s, "--namespace", "t*")
    yield op
    op.stop()
