"""The Helm chart: lint, template, the CRD copy, documented values, and a clean apply to the control plane."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest_k8s import ROOT, K8sEnv, wait_until

CHART = ROOT / "charts" / "stallfree"


def _helm() -> Path:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "testenv"), "paths"], capture_output=True, text=True, check=True
    )
    helm = Path(proc.stdout.split()[1]) / "helm"
    if not helm.exists():
        pytest.skip("helm is not installed: run scripts/testenv build")
    return helm


def helm(*args: str) -> str:
    proc = subprocess.run([str(_helm()), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc.stdout


def render(*sets: str, namespace: str = "stallfree-system") -> list[dict]:
    args = ["template", "demo", str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


def test_chart_crd_is_identical_to_crds_folder():
    assert (CHART / "crds" / "sarathideployment.yaml").read_bytes() == (
        ROOT / "crds" / "sarathideployment.yaml"
    ).read_bytes()


def test_every_value_is_documented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w-]*:", line):
            prev = next((p for p in reversed(lines[:i]) if p.strip()), "")
            if not prev.strip().startswith("#") and "#" not in line:
                undocumented.append(line.strip())
    assert not undocumented, f"values without a comment: {undocumented}"


def test_helm_lint():
    out = helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out


def test_template_default_is_cluster_wide_and_least_privilege():
    docs = render()
    kinds = sorted(
        d["kind"] for d in docs if d["kind"] not in ("ConfigMap", "PrometheusRule")
    )  # dashboards, alerts
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["stallfree", "operator"]
    assert "--all-namespaces" in container["args"]
    assert "--engine-image=stallfree/engine:0.1.0" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "demo-stallfree"
    rules = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]
    verbs = {
        (g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert "*" not in {v for vs in verbs.values() for v in vs}
    assert verbs[("", "secrets")] == {"get", "create"}  # never list or read all secrets
    assert ("", "namespaces") not in verbs and ("", "nodes") not in verbs
    assert verbs[("serving.stallfree.dev", "sarathideployments/status")] == {"get", "patch"}


def test_template_namespaced_uses_roles():
    docs = render("watch.namespaces={team-a,team-b}", "engine.image.tag=9.9", "operator.logLevel=verbose")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [r["rules"] for r in cluster_roles] == [
        [
            {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": ["apiextensions.k8s.io"],
                "resources": ["customresourcedefinitions"],
                "verbs": ["list", "watch"],
            },
        ]
    ]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert "--engine-image=stallfree/engine:9.9" in args and "--verbose" in args


@pytest.mark.k8s
def test_rendered_chart_applies_cleanly(k8s: K8sEnv, crd: dict):
    ns = "stallfree-chart"
    k8s.kubectl("create", "namespace", ns)
    rendered = helm("template", "demo", str(CHART), "--namespace", ns, "--include-crds")
    out = k8s.kubectl(
        "apply", "--server-side", "--force-conflicts", "-n", ns, "-f", "-", input=rendered
    ).stdout
    for obj in [
        "customresourcedefinition.apiextensions.k8s.io/sarathideployments.serving.stallfree.dev",
        "serviceaccount/demo-stallfree",
        "clusterrole.rbac.authorization.k8s.io/demo-stallfree",
        "clusterrolebinding.rbac.authorization.k8s.io/demo-stallfree",
        "deployment.apps/demo-stallfree",
    ]:
        assert obj in out, out

    # kwok runs the operator pod as a fake; it must at least be scheduled and Running on a CPU node.
    def running():
        pods = k8s.list("pods", ns, "app.kubernetes.io/component=operator")
        return pods and all(p["status"].get("phase") == "Running" for p in pods) and pods

    pods = wait_until(running, timeout=60, what="operator pod Running")
    assert pods[0]["spec"]["serviceAccountName"] == "demo-stallfree"
    # and helm itself can install the release against this API server
    helm_out = k8s.helm(
        "install", "other", str(CHART), "-n", ns, "--set", f"watch.namespaces={{{ns}}}", "--skip-crds"
    )
    assert "STATUS: deployed" in helm_out.stdout
    k8s.helm("uninstall", "other", "-n", ns)
    k8s.kubectl("delete", "-n", ns, "-f", "-", "--wait=false", input=_without_crd(rendered))


def _without_crd(rendered: str) -> str:
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] != "CustomResourceDefinition"]
    return yaml.safe_dump_all(docs)
