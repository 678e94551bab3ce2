"""Chart test fixtures: the real control plane from tests/conftest_k8s.py."""

from conftest_k8s import K8sEnv, crd, k8s, namespace  # noqa: F401  (fixtures)
