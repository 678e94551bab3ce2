"""The budget-controller timer's side effects, fast: Kubernetes in memory, metrics scripted, pods faked.

Regression guards for faults found while writing the real-operator test (test_controller_k8s.py):
- the timer passed kopf's logger where Reconciler.apply_children wants a (reason, message) recorder, so a
  change that rewrote engine.yaml raised TypeError after the ConfigMap was written, and kopf paused the
  timer for 60 s;
- the Events it meant to post were log lines only, and kopf does not post log lines (posting.loggers off);
- an IPv6 pod IP made an invalid admin URL: httpx.InvalidURL escaped the apply, so the timer failed every
  tick instead of holding.
"""

from __future__ import annotations

import base64
import copy
import logging
import types

import httpx
import pytest
import yaml
from controller_factories import make_snapshot
from fake_engine import FakeEngine
from promserver import free_port

from stallfree.operator.controller import applier as applier_module
from stallfree.operator.controller import kopf_timer
from stallfree.operator.controller.applier import ApplyFailed, EngineApplier
from stallfree.operator.controller.kopf_timer import pod_applier, step_resource
from stallfree.operator.controller.prometheus import MetricsUnavailable
from stallfree.operator.controller.types import Settings
from stallfree.operator.kube import Applied
from stallfree.operator.reconcile import OperatorConfig, Reconciler

SPEC = {
    "budget": {"initial": 1024, "min": 128, "max": 2048, "align": 32},
    "trafficClusters": [
        {"name": "chat", "slo": {"tbtP99Seconds": 0.1, "ttftP99Seconds": 1.0}, "priority": 10},
        {"name": "summarization", "slo": {"tbtP99Seconds": 0.25, "ttftP99Seconds": 10.0}},
    ],
    "controller": {"enabled": True, "intervalSeconds": 5, "windowSeconds": 10},
}
CONFIG = OperatorConfig(prometheus_url="http://prometheus.invalid:9090")
SLOW_CHAT = make_snapshot(
    chat=dict(tbt_p99=0.3, running=4), summarization=dict(tbt_p99=0.05, running=4)
)  # chat at 3x its TBT SLO


class MemoryKube:
    """The part of stallfree.operator.kube.Kube the reconciler uses, over a dict."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}

    def has_api(self, api_version: str, kind: str) -> bool:
        return False

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self.objects.get((kind, namespace, name))

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        return (
            [o for (k, _, _), o in self.objects.items() if k == kind] if kind == "Pod" else []
        )  # no pruning

    def create(self, manifest: dict) -> dict:
        return self.apply(manifest).obj

    def apply(self, manifest: dict) -> Applied:
        key = (manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        before = self.objects.get(key)
        self.objects[key] = copy.deepcopy(manifest)
        action = "created" if before is None else "unchanged" if before == manifest else "updated"
        return Applied(obj=manifest, action=action)


class Patch:
    def __init__(self) -> None:
        self.status: dict = {}


class ScriptedSource:
    """Hands out the next scripted snapshot, or raises it when it is an exception."""

    def __init__(self, script: list) -> None:
        self.script = script

    def snapshot(self, window_s: float, clusters: list[str]):
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def body(status: dict | None = None) -> dict:
    return {
        "apiVersion": "serving.stallfree.dev/v1alpha1",
        "kind": "SarathiDeployment",
        "metadata": {"name": "smollm2", "namespace": "llm", "generation": 1, "uid": "u"},
        "spec": copy.deepcopy(SPEC),
        "status": status or {},
    }


@pytest.fixture
def timer(monkeypatch):
    """step(now, script item) -> status doc; `posted` collects the Events, `kube` the children."""
    script: list = []
    monkeypatch.setattr(kopf_timer, "PrometheusSource", lambda *a, **k: ScriptedSource(script))
    kube = MemoryKube()
    memo = types.SimpleNamespace(reconciler=Reconciler(kube, CONFIG))
    memo.reconciler.reconcile(body(), lambda reason, message: None)  # the create handler ran first
    posted: list[tuple[str, str, str]] = []
    status: dict = {}

    def step(now: float, item) -> dict | None:
        script.append(item)
        p = Patch()
        doc = step_resource(
            body(status), p, logging.getLogger("kopf.test"), memo, CONFIG, now=now,
            post_event=lambda *event: posted.append(event),
        )  # fmt: skip
        status.update(p.status)
        return doc

    return types.SimpleNamespace(step=step, posted=posted, kube=kube)


def test_a_change_rewrites_engine_yaml_and_posts_events(timer):
    doc = timer.step(0.0, SLOW_CHAT)
    assert doc["budget"]["lastDecision"] == "lower" and doc["budget"]["tokenBudget"] < 1024
    config = timer.kube.get("v1", "ConfigMap", "llm", "smollm2-engine")
    assert yaml.safe_load(config["data"]["engine.yaml"])["tokenBudget"] == doc["budget"]["tokenBudget"]
    assert [(t, r) for t, r, _ in timer.posted] == [("Normal", "Tuned"), ("Normal", "Updated")]
    assert timer.posted[0][2].startswith("budget controller: lower (P99 TBT of chat")
    assert timer.posted[1][2] == "updated ConfigMap smollm2-engine"


def test_holding_posts_one_warning_when_it_starts(timer):
    gone = MetricsUnavailable("Prometheus at http://prometheus.invalid:9090 did not answer")
    timer.step(0.0, gone)
    timer.step(100.0, gone)
    warnings = [e for e in timer.posted if e[0] == "Warning"]
    assert [(t, r) for t, r, _ in warnings] == [("Warning", "HoldingSettings")]
    assert "holding last good settings: Prometheus at" in warnings[0][2]
    timer.step(200.0, SLOW_CHAT)  # metrics back: no longer holding
    timer.step(300.0, gone)
    assert len([e for e in timer.posted if e[0] == "Warning"]) == 2


def pod(name: str, ip: str, phase: str = "Running", uid: str = "", restarts: int = 0) -> dict:
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "uid": uid or f"uid-{name}"},
        "status": {
            "phase": phase,
            "podIP": ip,
            "containerStatuses": [{"name": "engine", "restartCount": restarts}],
        },
    }


def applier(*pods: dict, port: int = 8000, kube: MemoryKube | None = None) -> EngineApplier:
    kube = kube or MemoryKube()
    for p in pods:
        kube.apply(p)
    spec = kopf_timer.parse_spec({"engine": {"port": port}})
    return pod_applier(types.SimpleNamespace(kube=kube), "llm", "smollm2", spec)


def test_pod_applier_patches_running_pods_ipv4_and_ipv6(monkeypatch):
    urls: list[str] = []

    def patch(url: str, **kw) -> httpx.Response:
        urls.append(url)
        return httpx.Response(200, request=httpx.Request("PATCH", url))

    monkeypatch.setattr(applier_module.httpx, "patch", patch)
    applier(pod("a", "10.0.0.7"), pod("b", "fd00::7"), pod("c", "10.0.0.8", phase="Pending"))(
        Settings(256, 1, {})
    )
    assert urls == ["http://10.0.0.7:8000/admin/v1/config", "http://[fd00::7]:8000/admin/v1/config"]


def test_pod_applier_names_the_pods_it_could_not_reach():
    port = free_port()  # nothing listens there: connection refused
    with pytest.raises(ApplyFailed, match=r"^smollm2-x: .*(refused|connect)"):
        applier(pod("smollm2-x", "127.0.0.1"), port=port)(Settings(256, 1, {}))


def test_pod_applier_writes_a_pod_only_when_it_lacks_the_settings():
    """Counted on the engine's admin API: holds write nothing; a restarted container, a pod recreated
    under the same name and a change of settings are written once each; a Pending pod never."""
    kube = MemoryKube()
    engine = FakeEngine()
    try:
        apply = applier(pod("smollm2-0", "127.0.0.1"), pod("smollm2-1", "10.0.0.9", phase="Pending"),
                        port=engine.port, kube=kube)  # fmt: skip
        tuned = Settings(384, 1, {})
        for _ in range(4):
            apply(tuned)
        assert engine.patches == [tuned.engine_patch()]
        kube.apply(pod("smollm2-0", "127.0.0.1", restarts=1))  # the engine container restarted
        apply(tuned)
        apply(tuned)
        assert len(engine.patches) == 2
        kube.apply(pod("smollm2-0", "127.0.0.1", uid="recreated", restarts=1))
        apply(tuned)
        assert len(engine.patches) == 3
        apply(Settings(256, 1, {}))
        apply(Settings(256, 1, {}))
        assert len(engine.patches) == 4 and engine.config["tokenBudget"] == 256
    finally:
        engine.close()


def test_the_timer_patches_the_engine_pod_only_when_it_changes_settings(timer, monkeypatch):
    """Through the timer: a cut is written to the pod; the holds after it (SLOs in the hysteresis band)
    write nothing; the next change is written again."""
    secret = timer.kube.get("v1", "Secret", "llm", "smollm2-admin")
    token = secret.pop("stringData")["token"]
    timer.kube.apply({**secret, "data": {"token": base64.b64encode(token.encode()).decode()}})  # as stored
    engine = FakeEngine(admin_token=token)
    try:
        monkeypatch.setitem(SPEC, "engine", {"port": engine.port})  # the pod's engine answers there
        timer.kube.apply(pod("smollm2-0", "127.0.0.1"))
        in_band = make_snapshot(
            chat=dict(tbt_p99=0.09, running=4), summarization=dict(tbt_p99=0.05, running=4)
        )
        doc = timer.step(0.0, SLOW_CHAT)
        assert doc["budget"]["lastDecision"] == "lower" and len(engine.patches) == 1
        assert engine.config["tokenBudget"] == doc["budget"]["tokenBudget"]
        for i in range(1, 5):
            doc = timer.step(5.0 * i, in_band)
            assert doc["budget"]["lastDecision"] == "hold", doc["budget"]
        assert len(engine.patches) == 1, "a hold wrote to the pod"
        doc = timer.step(25.0, SLOW_CHAT)
        assert doc["budget"]["lastDecision"] == "lower" and len(engine.patches) == 2
    finally:
        engine.close()


def test_without_prometheus_the_condition_is_written_once():
    """No URL anywhere: say so in a condition, then stay quiet instead of patching status every tick."""
    status: dict = {}
    memo = types.SimpleNamespace()
    docs = []
    for now in (0.0, 5.0, 10.0):
        p = Patch()
        docs.append(
            step_resource(body(status), p, logging.getLogger("kopf.test"), memo, OperatorConfig(), now=now)
        )
        status.update(p.status)
    assert docs[0] is not None and docs[1:] == [None, None]
    (cond,) = [c for c in status["conditions"] if c["type"] == "MetricsAvailable"]
    assert cond["status"] == "False" and cond["reason"] == "NoPrometheus"
