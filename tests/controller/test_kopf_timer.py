"""The operator side of the controller: one timer tick against a real Prometheus, Kubernetes faked.

What it must do: tune from metrics, write status (never spec), post an Event per change, re-apply the
children so engine.yaml carries the tuned values, hold on missing metrics, continue from status on restart.
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
from fake_engine import FakeEngine
from promserver import PrometheusServer, available

from stallfree.operator.controller.kopf_timer import settings_from_status, step_resource
from stallfree.operator.reconcile import OperatorConfig

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not available(), reason="needs the prometheus binary (scripts/bootstrap --test)"),
]

SPEC = {
    "budget": {"initial": 1024, "min": 128, "max": 2048, "align": 32},
    "slo": {"ttftP99Seconds": 2.0, "tbtP99Seconds": 0.2, "schedulingDelayP50Seconds": 2.0},
    "trafficClusters": [
        {
            "name": "chat",
            "slo": {"tbtP99Seconds": 0.1, "ttftP99Seconds": 1.0},
            "priority": 10,
            "maxWaiting": 64,
        },
        {"name": "summarization", "slo": {"tbtP99Seconds": 0.25, "ttftP99Seconds": 10.0}, "chunkCap": 256},
    ],
    "controller": {"enabled": True, "intervalSeconds": 5, "windowSeconds": 10},
}


class FakeReconciler:
    def __init__(self) -> None:
        self.applied: list[dict] = []
        self.kube = types.SimpleNamespace(list=lambda *a, **k: [], get=lambda *a, **k: None)

    def context(self, body):
        return body

    def apply_children(self, ctx, events):
        self.applied.append(ctx)
        return []


class Patch:
    def __init__(self) -> None:
        self.status: dict = {}
        self.spec: dict = {}


def body(status=None, generation=1):
    return {
        "metadata": {"name": "smollm2", "namespace": "llm", "generation": generation, "uid": "u"},
        "spec": copy.deepcopy(SPEC),
        "status": status or {},
    }


@pytest.fixture(scope="module")
def fleet():
    engine = FakeEngine()
    engine.latency["chat"]["tbt"] = 0.3  # 3x the chat SLO
    prom = PrometheusServer().start()
    prom.set_targets([engine.target], {"namespace": "llm", "service": "smollm2"})
    prom.wait_for(
        'histogram_quantile(0.99, sum by (le) (rate(stallfree_time_between_tokens_seconds_bucket{service="smollm2"}[5s])))',
        pred=lambda rows: rows and rows[0]["value"][1] != "NaN" and float(rows[0]["value"][1]) > 0.2,
    )
    yield engine, prom
    prom.close()
    engine.close()


def test_tick_tunes_writes_status_and_events(fleet, caplog):
    _, prom = fleet
    memo = types.SimpleNamespace(reconciler=FakeReconciler())
    cfg = OperatorConfig(prometheus_url=prom.url)
    logger = logging.getLogger("kopf.test")
    p = Patch()
    step_resource(body(), p, logger, memo, cfg, now=0.0)  # builds the loop; a fresh loop waits a cooldown
    slot = memo.budget_controller
    slot.loop.state = type(slot.loop.state)()  # past the start-up cooldown
    p = Patch()
    with caplog.at_level(logging.INFO, logger="kopf.test"):
        doc = step_resource(body(), p, logger, memo, cfg, now=100.0)
    assert p.spec == {}, "the controller must never write spec"
    assert doc["budget"]["tokenBudget"] < 1024 and doc["budget"]["lastDecision"] == "lower"
    chat = next(c for c in doc["trafficClusters"] if c["name"] == "chat")
    assert chat["observedTbtP99Seconds"] > 0.1 and chat["sloMet"] is False
    conds = {c["type"]: c["status"] for c in doc["conditions"]}
    assert conds == {"MetricsAvailable": "True", "SettingsApplied": "True", "SLOMet": "False"}
    assert any("budget controller: lower" in r.getMessage() for r in caplog.records)
    # The children are re-applied from a body whose status carries the tuned budget (engine.yaml follows).
    assert memo.reconciler.applied[-1]["status"]["budget"]["tokenBudget"] == doc["budget"]["tokenBudget"]
    # Not yet time for the next decision: nothing written.
    assert step_resource(body(), Patch(), logger, memo, cfg, now=101.0) is None


def test_restart_continues_from_status_and_holds_without_prometheus(fleet):
    _, prom = fleet
    tuned = {"budget": {"tokenBudget": 384}, "desiredReplicas": 1,
             "trafficClusters": [{"name": "summarization", "chunkCap": 192, "maxWaiting": 8}]}  # fmt: skip
    memo = types.SimpleNamespace(reconciler=FakeReconciler())
    cfg = OperatorConfig(prometheus_url="http://127.0.0.1:1")  # nothing listens there
    p = Patch()
    doc = step_resource(body(tuned), p, logging.getLogger("kopf.test"), memo, cfg, now=0.0)
    assert doc["budget"]["tokenBudget"] == 384, (
        "a restarted controller must not jump back to spec.budget.initial"
    )
    summ = next(c for c in doc["trafficClusters"] if c["name"] == "summarization")
    assert summ["chunkCap"] == 192 and summ["maxWaiting"] == 8
    cond = {c["type"]: c for c in doc["conditions"]}["MetricsAvailable"]
    assert cond["status"] == "False" and cond["reason"] == "HoldingSettings"
    assert memo.reconciler.applied == []


def test_a_profile_in_the_spec_reaches_the_loop():
    """spec.controller.costModel is what the operator's loop plans with (trusted in seconds)."""
    coeffs = {"const": 0.05, "prefillTokens": 2e-3, "decodeTokens": 4e-3, "decodeAttn": 2e-5}
    b = body()
    b["spec"]["controller"]["costModel"] = coeffs
    memo = types.SimpleNamespace(reconciler=FakeReconciler())
    cfg = OperatorConfig(prometheus_url="http://127.0.0.1:1")
    step_resource(b, Patch(), logging.getLogger("kopf.test"), memo, cfg, now=0.0)
    model = memo.budget_controller.loop.model
    assert model.absolute
    assert model.iteration_time(256, 10, 100) == pytest.approx(
        0.05 + 256 * 2e-3 + 10 * 4e-3 + 10 * 101 * 2e-5
    )
    plain = types.SimpleNamespace(reconciler=FakeReconciler())
    step_resource(body(), Patch(), logging.getLogger("kopf.test"), plain, cfg, now=0.0)
    assert not plain.budget_controller.loop.model.absolute


def test_settings_from_status_falls_back():
    from stallfree.operator.controller.types import Knobs, Settings

    fb = Settings(512, 1, {"chat": Knobs(None, 64, None)})
    assert settings_from_status(None, 2, fb) == Settings(512, 2, {"chat": Knobs(None, 64, None)})
    tuned_in_time = {"budget": {"mode": "time", "tokenBudget": 4096, "timeTarget": 0.5}}
    assert settings_from_status(tuned_in_time, 1, fb).token_budget == 512  # a cap is no tuned token budget
    timed = Settings(4096, 1, {}, time_target=0.8)
    tuned_in_tokens = {"budget": {"mode": "tokens", "tokenBudget": 384}}
    assert settings_from_status(tuned_in_tokens, 1, timed).time_target == 0.8
    assert settings_from_status(tuned_in_time, 1, timed).time_target == 0.5


def time_body(status=None):
    b = body(status)
    b["spec"]["budget"] = {"min": 128, "max": 2048, "align": 32}  # no initial: time mode, target 0.8
    return b


def test_time_mode_tick_lowers_the_target_and_warns_once_when_calibration_goes(fleet):
    engine, prom = fleet
    memo = types.SimpleNamespace(reconciler=FakeReconciler())
    cfg = OperatorConfig(prometheus_url=prom.url)
    logger = logging.getLogger("kopf.test")
    events: list[tuple[str, str, str]] = []

    def post(*event: str) -> None:
        events.append(event)

    step_resource(time_body(), Patch(), logger, memo, cfg, now=0.0, post_event=post)
    memo.budget_controller.loop.state = type(memo.budget_controller.loop.state)()
    doc = step_resource(time_body(), Patch(), logger, memo, cfg, now=100.0, post_event=post)
    budget = doc["budget"]
    assert budget["mode"] == "time" and budget["lastDecision"] == "lower", budget
    assert budget["tokenBudget"] == 2048 and budget["timeTarget"] < 0.8
    assert budget["costModelErrorP95"] == pytest.approx(0.12)
    conds = {c["type"]: c for c in doc["conditions"]}
    assert conds["CostModelCalibrated"]["status"] == "True"
    assert {e[1] for e in events} == {"Tuned"}  # no Warning while calibrated
    assert memo.reconciler.applied[-1]["status"]["budget"]["timeTarget"] == budget["timeTarget"]

    engine.cal_error.labels("0.95").set(0.9)
    try:
        prom.wait_for(
            'max(stallfree_cost_model_error_ratio{quantile="0.95"})',
            pred=lambda rows: rows and float(rows[0]["value"][1]) > 0.5,
        )
        doc = step_resource(time_body(doc), Patch(), logger, memo, cfg, now=200.0, post_event=post)
        cond = {c["type"]: c for c in doc["conditions"]}["CostModelCalibrated"]
        assert cond["status"] == "False" and "by 0.90" in cond["message"]
        warnings = [e for e in events if e[0] == "Warning"]
        assert [w[1] for w in warnings] == ["CostModelMiscalibrated"] and "by 0.90" in warnings[0][2]
        doc = step_resource(time_body(doc), Patch(), logger, memo, cfg, now=300.0, post_event=post)
        assert len([e for e in events if e[0] == "Warning"]) == 1  # said once, not every tick
        assert doc["budget"]["lastDecision"] != "raise"
    finally:
        engine.cal_error.labels("0.95").set(0.12)


def test_a_time_mode_restart_continues_from_the_target_in_status():
    tuned = {"budget": {"mode": "time", "tokenBudget": 2048, "timeTarget": 0.45, "lastDecision": "lower"}}
    memo = types.SimpleNamespace(reconciler=FakeReconciler())
    cfg = OperatorConfig(prometheus_url="http://127.0.0.1:1")
    doc = step_resource(time_body(tuned), Patch(), logging.getLogger("kopf.test"), memo, cfg, now=0.0)
    assert doc["budget"]["timeTarget"] == 0.45 and doc["budget"]["tokenBudget"] == 2048
    over = {"budget": {"timeTarget": 0.95, "tokenBudget": 512}}  # above the spec's, a tokens-mode budget
    memo = types.SimpleNamespace(reconciler=FakeReconciler())
    doc = step_resource(time_body(over), Patch(), logging.getLogger("kopf.test"), memo, cfg, now=0.0)
    assert doc["budget"]["timeTarget"] == 0.8 and doc["budget"]["tokenBudget"] == 2048
