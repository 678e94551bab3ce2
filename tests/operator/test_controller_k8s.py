"""The budget controller inside the real operator process, on a real API server, reading a real Prometheus.

tests/controller/test_kopf_timer.py drives one timer tick with Kubernetes faked; here everything around
the timer is real: `stallfree operator --prometheus-url ...` runs as a process against the testenv API
server (kopf, its timers, status patches, Events, the ConfigMap it re-applies), and Debian's Prometheus
scrapes the engine and answers the controller's PromQL.

What is faked, and why:
- Pods are kwok's: nothing runs in them. The engine pod is scheduled onto a kwok node of this module whose
  podCIDR is in 127.0.0.0/8, so kwok gives the pod a loopback IP that this machine answers on.
- The engine is tests/controller/fake_engine.py's FakeEngine (no model: the test sets the latencies it
  exports), listening on that pod IP and the spec's engine port. So Prometheus scrapes the pod's address,
  with the labels a ServiceMonitor would give the series (namespace, service), and the operator's PATCH
  /admin/v1/config reaches "the pod" with the admin token from the Secret the operator created.
On kwok's ordinary nodes pod IPs (10.244.0.0/16) reach no engine: every apply would fail and the controller
would only ever hold. That path (an engine that does not take settings) is checked here by making the
FakeEngine answer 503; test_budget_timer.py checks a pod nobody answers on.

Phases: (1) chat P99 TBT at 3x its SLO -> a lowered budget in status, on the engine, in engine.yaml, with
Events, spec untouched; (2) SLOs met -> the controller holds, and no PATCH reaches the pod while it does;
(3) the engine refuses the raise that TTFT pressure calls for -> holding, said in status and in a Warning;
(4) Prometheus stopped -> MetricsAvailable=False, the last good settings held.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator

import pytest
import yaml
from conftest_k8s import GROUP, VERSION, K8sEnv, OperatorProcess, wait_until
from fake_engine import FakeEngine
from promserver import PrometheusServer, available, free_port

from stallfree.operator.controller.kopf_timer import TICK_SECONDS

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.prometheus,
    pytest.mark.slow,
    pytest.mark.skipif(not available(), reason="needs the prometheus binary (scripts/bootstrap --test)"),
]

NAME = "chat-llm"
NODE = "loopback-node-0"
TAINT = "stallfree.dev/loopback-pods"  # only this module's pods tolerate it: other tests keep off the node
POD_CIDR = "127.86.0.0/24"
INITIAL_BUDGET = 1024
WAIT = 90.0  # generous: the box has 2 shared cores and the timer ticks every TICK_SECONDS


def sarathi(port: int) -> dict:
    """A one-replica fleet with a chat SLO the FakeEngine will miss, pinned to the loopback node."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SarathiDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "SmolLM2-135M-Instruct"},
            "replicas": {"min": 1, "max": 1},
            "resources": {
                "gpusPerPod": 1,
                "cpu": "1",
                "memory": "1Gi",
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "tolerations": [{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}],
            },
            "engine": {"port": port},
            "budget": {"initial": INITIAL_BUDGET, "min": 128, "max": 2048, "align": 32},
            "trafficClusters": [
                {"name": "chat", "slo": {"tbtP99Seconds": 0.1, "ttftP99Seconds": 1.0}, "priority": 10},
                {"name": "summarization", "slo": {"tbtP99Seconds": 0.25, "ttftP99Seconds": 10.0}},
            ],
            # The kopf timer ticks every TICK_SECONDS: a shorter interval (the CRD allows 1) acts the same.
            "controller": {"enabled": True, "intervalSeconds": int(TICK_SECONDS), "windowSeconds": 10},
        },
    }


@pytest.fixture(scope="module")
def loopback_node(k8s: K8sEnv) -> Iterator[str]:
    """A kwok node that hands out loopback pod IPs, tainted so that only this module's pods land there."""
    labels = {"kubernetes.io/hostname": NODE, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "2"}
    k8s.apply(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE, "annotations": {"kwok.x-k8s.io/node": "fake"}, "labels": labels},
            "spec": {
                "podCIDR": POD_CIDR,
                "taints": [{"key": TAINT, "value": "true", "effect": "NoSchedule"}],
            },
            "status": {"allocatable": capacity, "capacity": capacity},
        }
    )

    def ready() -> bool:
        node = k8s.get("node", NODE) or {}
        conds = (node.get("status") or {}).get("conditions") or []
        taints = {t["key"] for t in (node.get("spec") or {}).get("taints") or []}
        return taints == {TAINT} and any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    wait_until(ready, timeout=60, what=f"node {NODE} Ready without the not-ready taint")
    yield NODE
    k8s.kubectl("delete", "node", NODE, "--wait=false", check=False)


@pytest.fixture
def ctl_namespace(k8s: K8sEnv, loopback_node: str) -> Iterator[str]:
    """A namespace that the session's `operator_all` (watching t*) leaves alone; its pods are gone before
    the node is deleted (kwok, acting as the node's kubelet, finishes their deletion)."""
    ns = f"x-controller-{secrets.token_hex(3)}"
    k8s.kubectl("create", "namespace", ns)
    yield ns
    k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    try:
        wait_until(lambda: not k8s.list("pods", ns), timeout=30, what="pods gone")
    except pytest.fail.Exception:
        pass  # the namespace goes anyway; the node only lingers


@pytest.fixture
def prometheus() -> Iterator[PrometheusServer]:
    prom = PrometheusServer().start()
    yield prom
    prom.close()


def condition(cr: dict, ctype: str) -> dict:
    return next((c for c in cr.get("status", {}).get("conditions") or [] if c["type"] == ctype), {})


def engine_yaml(k8s: K8sEnv, ns: str) -> dict:
    return yaml.safe_load(k8s.get("configmap", f"{NAME}-engine", ns)["data"]["engine.yaml"])


def knobs(cr: dict) -> dict:
    """The tuned values in status: the token budget and each cluster's admission knobs."""
    st = cr["status"]
    clusters = {
        c["name"]: {k: c.get(k) for k in ("chunkCap", "maxWaiting", "maxRunning")}
        for c in st["trafficClusters"]
    }
    return {"tokenBudget": st["budget"]["tokenBudget"], "clusters": clusters}


def events(k8s: K8sEnv, ns: str, text: str) -> list[dict]:
    return [
        e
        for e in k8s.list("events", ns)
        if e["involvedObject"]["kind"] == "SarathiDeployment" and text in e["message"]
    ]


def start_engine(k8s: K8sEnv, ns: str, port: int) -> FakeEngine:
    """The FakeEngine at the engine pod's address, with the admin token the operator generated."""

    def pod_ip() -> str | None:
        for pod in k8s.list("pods", ns, f"serving.stallfree.dev/deployment={NAME}"):
            st = pod.get("status") or {}
            if (
                st.get("phase") == "Running"
                and st.get("podIP")
                and not pod["metadata"].get("deletionTimestamp")
            ):
                return st["podIP"]
        return None

    ip = wait_until(pod_ip, timeout=WAIT, what="the engine pod Running with an IP")
    assert str(ip).startswith("127.86."), f"pod IP {ip} is not from the loopback node's podCIDR"
    secret = wait_until(lambda: k8s.get("secret", f"{NAME}-admin", ns), timeout=WAIT, what="admin Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    return FakeEngine(host=str(ip), port=port, admin_token=token)


def hold_for_ticks(k8s: K8sEnv, ns: str, held: dict, ticks: int = 2) -> dict:
    """Wait for `ticks` more timer decisions (status.budget.lastDecisionTime moves), checking at every
    look that the tuned values in status stay `held`. Returns the last CR seen."""
    seen: list[str] = []

    def ticked() -> dict | None:
        cr = k8s.get("sarathideployment", NAME, ns)
        assert knobs(cr) == held, "settings changed while the controller was holding"
        t = cr["status"]["budget"].get("lastDecisionTime")
        if not seen or seen[-1] != t:
            seen.append(t)
        return cr if len(seen) > ticks else None

    return wait_until(ticked, timeout=WAIT, what=f"{ticks} more controller ticks while holding")


def test_budget_controller_tunes_holds_and_never_writes_spec(
    k8s: K8sEnv, crd: dict, ctl_namespace: str, prometheus: PrometheusServer
):
    ns, port = ctl_namespace, free_port()
    op = OperatorProcess(k8s, "--namespace", ns, "--prometheus-url", prometheus.url)
    engine: FakeEngine | None = None
    try:
        k8s.apply(sarathi(port), ns)
        applied = k8s.get("sarathideployment", NAME, ns)
        engine = start_engine(k8s, ns, port)
        engine.latency["chat"]["tbt"] = 0.3  # 3x the chat SLO: the budget must come down
        # The labels a ServiceMonitor on the operator's Service gives the series (fleet_selector).
        prometheus.set_targets([engine.target], {"namespace": ns, "service": NAME})

        # ---- 1. tuned: a lowered budget in status, applied to the engine and to engine.yaml ----------
        def lowered() -> dict | None:
            cr = k8s.get("sarathideployment", NAME, ns)
            st = cr.get("status") or {}
            budget = (st.get("budget") or {}).get("tokenBudget") or INITIAL_BUDGET
            ok = (
                budget < INITIAL_BUDGET
                and condition(cr, "MetricsAvailable").get("status") == "True"
                and condition(cr, "SLOMet").get("status") == "False"
            )
            return cr if ok else None

        cr = wait_until(lowered, timeout=WAIT, what="a lowered token budget in status")
        budget = cr["status"]["budget"]
        assert budget["reason"] and budget["lastDecision"] and budget["lastDecisionTime"]
        chat = next(c for c in cr["status"]["trafficClusters"] if c["name"] == "chat")
        assert chat["observedTbtP99Seconds"] > 0.1 and chat["sloMet"] is False and chat["reason"]
        assert "chat" in condition(cr, "SLOMet")["message"]
        # GitOps: the tuned values live in status only.
        assert cr["spec"] == applied["spec"]
        assert cr["metadata"]["generation"] == applied["metadata"]["generation"]
        wait_until(
            lambda: events(k8s, ns, "budget controller: lower"), timeout=WAIT, what="an Event for the change"
        )
        wait_until(
            lambda: events(k8s, ns, f"updated ConfigMap {NAME}-engine"),
            timeout=WAIT,
            what="an Event for engine.yaml rewritten by the timer",
        )
        assert engine.patches and min(p["tokenBudget"] for p in engine.patches) < INITIAL_BUDGET

        # The engine, engine.yaml and status agree (the budget keeps falling while TBT stays high: compare
        # one consistent look, not the first).
        def consistent() -> bool:
            st = knobs(k8s.get("sarathideployment", NAME, ns))
            return engine_yaml(k8s, ns)["tokenBudget"] == st["tokenBudget"] == engine.config["tokenBudget"]

        wait_until(consistent, timeout=WAIT, what="engine.yaml, status and the engine on the same budget")

        # ---- 2. SLOs met: every tick holds, and a hold writes nothing to the pod ----------------------
        engine.latency["chat"]["tbt"] = 0.09  # inside the hysteresis band: no cut, no raise

        def steady() -> dict | None:
            cr = k8s.get("sarathideployment", NAME, ns)
            return cr if cr["status"]["budget"].get("reason") == "SLOs met" else None

        cr = wait_until(steady, timeout=WAIT, what="the controller holding with every SLO met")
        patches = len(engine.patches)
        cr = hold_for_ticks(k8s, ns, knobs(cr), ticks=3)
        assert cr["status"]["budget"]["lastDecision"] == "hold", cr["status"]["budget"]
        assert len(engine.patches) == patches, "the controller PATCHed the pod while holding"
        assert condition(cr, "SettingsApplied")["status"] == "True"

        # ---- 3. the engine refuses settings: hold, say why, change nothing ----------------------------
        # A change must be due for a refusal to show: TTFT over its SLO with TBT slack calls for a raise.
        engine.latency["chat"].update(tbt=0.03, ttft=2.5)
        engine.admin_error = 503

        def refused() -> dict | None:
            cr = k8s.get("sarathideployment", NAME, ns)
            c = condition(cr, "SettingsApplied")
            return cr if c.get("status") == "False" else None

        cr = wait_until(refused, timeout=WAIT, what="holding because the engine refused the settings")
        c = condition(cr, "SettingsApplied")
        assert c["reason"] == "ApplyFailed" and "503" in c["message"], c
        assert condition(cr, "MetricsAvailable")["status"] == "True", (
            "the metrics were fine: only the apply failed"
        )
        held = knobs(cr)
        assert engine_yaml(k8s, ns)["tokenBudget"] == held["tokenBudget"] == engine.config["tokenBudget"]
        hold_for_ticks(k8s, ns, held)
        assert engine_yaml(k8s, ns)["tokenBudget"] == held["tokenBudget"]
        assert events(k8s, ns, "holding settings: could not apply settings")
        assert op.healthy()

        # ---- 4. Prometheus gone: hold the last good settings --------------------------------------
        engine.admin_error = None
        wait_until(
            lambda: (
                condition(k8s.get("sarathideployment", NAME, ns), "SettingsApplied").get("status") == "True"
            ),
            timeout=WAIT,
            what="the controller back to normal once the engine takes settings again",
        )
        prometheus.stop()

        def no_metrics() -> dict | None:
            cr = k8s.get("sarathideployment", NAME, ns)
            c = condition(cr, "MetricsAvailable")
            return cr if c.get("status") == "False" and "did not answer" in c.get("message", "") else None

        cr = wait_until(no_metrics, timeout=WAIT, what="MetricsAvailable=False once Prometheus is gone")
        assert condition(cr, "MetricsAvailable")["reason"] == "HoldingSettings"
        assert cr["status"]["budget"]["lastDecision"] == "hold"
        assert "holding last good settings" in cr["status"]["budget"]["reason"]
        held, patches = knobs(cr), len(engine.patches)
        hold_for_ticks(k8s, ns, held)
        assert engine_yaml(k8s, ns)["tokenBudget"] == held["tokenBudget"] == engine.config["tokenBudget"]
        assert len(engine.patches) == patches, "nothing is applied without metrics"
        assert events(k8s, ns, "holding settings: holding last good settings: Prometheus at")
        final = k8s.get("sarathideployment", NAME, ns)
        assert final["spec"] == applied["spec"]
        assert final["metadata"]["generation"] == applied["metadata"]["generation"]
        assert op.healthy()
        assert "Traceback" not in op.log(), op.log()
    finally:
        op.stop()
        if engine is not None:
            engine.close()
