"""The operator works with exactly the chart's RBAC: run it as the chart's ServiceAccount (token auth).

The chart is rendered for the namespace the operator watches (Roles + the namespaces reader); the
cluster-wide ClusterRole carries the same rules (one template, checked in tests/chart).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest_k8s import ROOT, K8sEnv, OperatorProcess, wait_until

pytestmark = pytest.mark.k8s
CHART = ROOT / "charts" / "stallfree"
RELEASE_NS = "stallfree-rbac"
WATCHED_NS = "x-rbac"
SA = f"system:serviceaccount:{RELEASE_NS}:demo-stallfree"


def _sa_kubeconfig(k8s: K8sEnv) -> Path:
    token = k8s.kubectl("create", "token", "demo-stallfree", "-n", RELEASE_NS, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(k8s.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testenv", "cluster": cluster}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "testenv", "user": "operator"}}],
        "current-context": "operator",
    }
    path = Path(tempfile.mkstemp(prefix="stallfree-sa-", suffix=".kubeconfig")[1])
    path.write_text(yaml.safe_dump(config))
    return path


def test_operator_runs_with_only_the_charts_rbac(k8s: K8sEnv, crd: dict):
    helm = k8s.tool_dir / "helm"
    rendered = subprocess.run(
        [str(helm), "template", "demo", str(CHART), "--namespace", RELEASE_NS, "--set", f"watch.namespaces={{{WATCHED_NS}}}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rbac_kinds = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    rbac = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in rbac_kinds]
    for ns in (RELEASE_NS, WATCHED_NS):
        k8s.kubectl("create", "namespace", ns)
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))

    # least privilege, as the API server sees it
    def can(verb: str, resource: str, ns: str = WATCHED_NS) -> bool:
        proc = k8s.kubectl("auth", "can-i", verb, resource, "-n", ns, f"--as={SA}", check=False)
        return proc.stdout.strip() == "yes"

    assert can("patch", "sarathideployments.serving.stallfree.dev")
    assert can("create", "deployments.apps")
    assert not can("list", "secrets") and not can("delete", "secrets")
    assert not can("delete", "sarathideployments.serving.stallfree.dev")
    assert not can("create", "pods") and not can("delete", "nodes", "")
    assert not can("create", "deployments.apps", "default")  # nothing outside the watched namespace

    op = OperatorProcess(k8s, "--namespace", WATCHED_NS, kubeconfig=_sa_kubeconfig(k8s))
    try:
        k8s.kubectl("apply", "-n", WATCHED_NS, "-f", "examples/sarathideployment.yaml")

        def ready():
            cr = k8s.get("sarathideployment", "smollm2", WATCHED_NS)
            conds = {c["type"]: c["status"] for c in ((cr or {}).get("status") or {}).get("conditions", [])}
            return conds.get("Ready") == "True"

        wait_until(ready, timeout=60, what="Ready under the chart's RBAC")
        events = k8s.list("events", WATCHED_NS)
        assert any(
            e["involvedObject"]["kind"] == "SarathiDeployment" and e["reason"] == "Created" for e in events
        )
        # the drift timer (which also prunes: list + delete) runs clean too
        wait_until(lambda: op.log().count("Timer 'resync' succeeded") >= 2, timeout=30, what="resync rounds")
        log = op.log()
        assert "403" not in log and "Forbidden" not in log and "forbidden" not in log, log
    finally:
        op.stop()
        for ns in (WATCHED_NS, RELEASE_NS):
            k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)
