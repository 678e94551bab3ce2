"""The budget controller's fields of the SarathiDeployment status (operator/status.py), rendered from a
control loop's last step: the whole document for one step, then what changes with the step.

The loop runs on a scripted source and applier with a fixed clock; nothing here does I/O.
"""

from __future__ import annotations

from controller_factories import make_config, make_snapshot, make_specs

from stallfree.operator.controller.applier import ApplyFailed
from stallfree.operator.controller.loop import ControlLoop
from stallfree.operator.controller.prometheus import MetricsUnavailable
from stallfree.operator.controller.types import State
from stallfree.operator.status import controller_status, merge_conditions

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
SLOW_CHAT = make_snapshot(
    chat=dict(tbt_p99=0.31234, ttft_p99=0.4, running=8, waiting=2.345, arrival_rate=1.23456),
    summarization=dict(tbt_p99=0.05, running=2),
)


def make_loop(script: list, refuse: list[str] | None = None) -> ControlLoop:
    class Source:
        def snapshot(self, window_s, clusters):
            item = script.pop(0)
            if isinstance(item, Exception):
                raise item
            return item

    def apply(settings) -> None:
        if refuse:
            raise ApplyFailed(refuse[0])

    loop = ControlLoop.start(
        make_specs(), make_config(), 1024, 1, source=Source(), apply=apply, clock=lambda: T0
    )
    loop.state = State()  # no start-up cooldown: act on the first step
    return loop


def test_the_document_after_a_cut():
    loop = make_loop([SLOW_CHAT])
    step = loop.step()
    budget = loop.settings.token_budget
    assert step.action == "lower" and budget < 1024
    when = "2026-01-01T00:00:00Z"
    assert controller_status(loop) == {
        "budget": {
            "mode": "tokens",
            "tokenBudget": budget,
            "observedTbtP99Seconds": 0.3123,
            "lastDecision": "lower",
            "lastDecisionTime": when,
            "reason": step.reason,
        },
        "desiredReplicas": 1,
        "trafficClusters": [
            {
                "name": "chat",
                "tokenBudget": budget,
                "chunkCap": budget,
                "maxWaiting": 64,
                "observedTtftP99Seconds": 0.4,
                "observedTbtP99Seconds": 0.3123,
                "queueLength": 2.35,
                "arrivalRate": 1.235,
                "sloMet": False,
                "lastDecision": "lower",
                "reason": step.reason,
                "lastDecisionTime": when,
            },
            {
                "name": "summarization",
                "tokenBudget": budget,
                "chunkCap": min(256, budget),
                "maxWaiting": 32,
                "observedTbtP99Seconds": 0.05,
                "queueLength": 0.0,
                "arrivalRate": 0.0,
                "sloMet": True,
                "lastDecision": "lower",
                "reason": step.reason,
                "lastDecisionTime": when,
            },
        ],
        "conditions": [
            {"type": "MetricsAvailable", "status": "True", "reason": "MetricsRead",
             "message": "engine metrics are fresh", "lastTransitionTime": when},
            {"type": "SettingsApplied", "status": "True", "reason": "Applied",
             "message": "every engine runs the settings in status", "lastTransitionTime": when},
            {"type": "SLOMet", "status": "False", "reason": "SLOViolated", "message": step.reason,
             "lastTransitionTime": when},
        ],
    }  # fmt: skip


def test_before_any_step_only_the_settings_and_no_verdict_on_slos():
    loop = make_loop([])
    doc = controller_status(loop)
    assert doc["budget"] == {"mode": "tokens", "tokenBudget": 1024}
    assert [set(c) for c in doc["trafficClusters"]] == [{"name", "tokenBudget", "chunkCap", "maxWaiting"}] * 2
    slo = {c["type"]: c for c in doc["conditions"]}["SLOMet"]
    assert (slo["status"], slo["reason"]) == ("Unknown", "NoData")


def test_a_shed_names_only_the_cluster_it_acted_on():
    loop = make_loop([SLOW_CHAT])
    loop.step()
    d = loop.last.decision
    object.__setattr__(d, "cluster_actions", {"summarization": "shed"})  # as a shed decides
    object.__setattr__(d, "cluster_reasons", {"summarization": "shed it"})
    chat, summ = controller_status(loop)["trafficClusters"]
    assert (chat["lastDecision"], chat["reason"]) == ("lower", loop.last.reason)  # the fleet's
    assert (summ["lastDecision"], summ["reason"]) == ("shed", "shed it")


def test_holding_is_told_apart_by_its_cause():
    loop = make_loop([MetricsUnavailable("Prometheus at http://p:9090 did not answer")])
    loop.step()
    doc = controller_status(loop)
    c = {x["type"]: x for x in doc["conditions"]}
    assert (c["MetricsAvailable"]["status"], c["MetricsAvailable"]["reason"]) == ("False", "HoldingSettings")
    assert "did not answer" in c["MetricsAvailable"]["message"]
    assert c["SettingsApplied"]["status"] == "True"
    assert doc["budget"]["lastDecision"] == "hold" and "observedTbtP99Seconds" not in doc["budget"]
    assert all("observedTbtP99Seconds" not in x for x in doc["trafficClusters"])

    refused = make_loop([SLOW_CHAT], refuse=["engine-0: HTTP 503"])
    refused.step()
    c = {x["type"]: x for x in controller_status(refused)["conditions"]}
    assert c["MetricsAvailable"]["status"] == "True"
    assert (c["SettingsApplied"]["status"], c["SettingsApplied"]["reason"]) == ("False", "ApplyFailed")
    assert c["SettingsApplied"]["message"] == "holding last good settings: engine-0: HTTP 503"


def test_merged_into_status_a_condition_keeps_when_it_last_moved():
    loop = make_loop([SLOW_CHAT])
    loop.step()
    old = [{"type": "SLOMet", "status": "False", "reason": "SLOViolated", "message": "x",
            "lastTransitionTime": "2025-12-31T23:00:00Z"},
           {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "1/1",
            "lastTransitionTime": "2025-12-31T22:00:00Z"}]  # fmt: skip
    new = controller_status(loop)["conditions"]
    merged = {c["type"]: c for c in merge_conditions(old, new, now="2026-01-01T00:00:00Z")}
    assert merged["SLOMet"]["lastTransitionTime"] == "2025-12-31T23:00:00Z"  # still False
    assert merged["MetricsAvailable"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert merged["Ready"]["status"] == "True"  # the operator's own conditions are kept


def make_time_loop(script: list) -> ControlLoop:
    """A time-mode loop (spec time target 0.8, cap 2048) on a scripted source."""

    class Source:
        def snapshot(self, window_s, clusters):
            return script.pop(0)

    loop = ControlLoop.start(
        make_specs(), make_config(time_target=0.8), 2048, 1,
        source=Source(), apply=lambda s: None, clock=lambda: T0,
    )  # fmt: skip
    loop.state = State()
    return loop


def with_error(snap, error: float | None):
    return snap.__class__(snap.time, snap.clusters, snap.replicas_seen, snap.kv_cache_usage, error)


def test_time_mode_status_shows_the_target_in_force_and_the_calibration():
    loop = make_time_loop([with_error(SLOW_CHAT, 0.1234)])
    before = controller_status(loop)
    assert before["budget"] == {"mode": "time", "tokenBudget": 2048, "timeTarget": 0.8}
    step = loop.step()
    doc = controller_status(loop)
    assert step.action == "lower" and doc["budget"]["timeTarget"] == loop.settings.time_target < 0.8
    assert doc["budget"]["tokenBudget"] == 2048 and doc["budget"]["costModelErrorP95"] == 0.1234
    c = {x["type"]: x for x in doc["conditions"]}["CostModelCalibrated"]
    assert (c["status"], c["reason"]) == ("True", "Calibrated") and "0.12" in c["message"]


def test_a_miscalibrated_cost_model_is_a_false_condition_with_the_measured_error():
    loop = make_time_loop([with_error(SLOW_CHAT, 0.73)])
    loop.step()
    c = {x["type"]: x for x in controller_status(loop)["conditions"]}["CostModelCalibrated"]
    assert (c["status"], c["reason"]) == ("False", "Miscalibrated")
    assert "by 0.73" in c["message"] and "limit 0.5" in c["message"] and "not raised" in c["message"]
    unknown = make_time_loop([SLOW_CHAT])
    unknown.step()
    c = {x["type"]: x for x in controller_status(unknown)["conditions"]}["CostModelCalibrated"]
    assert (c["status"], c["reason"]) == ("Unknown", "NoData")
    tokens = make_loop([with_error(SLOW_CHAT, 0.73)])
    tokens.step()
    doc = controller_status(tokens)
    assert "CostModelCalibrated" not in {x["type"] for x in doc["conditions"]}  # the time mode's concern
    assert doc["budget"]["costModelErrorP95"] == 0.73 and "timeTarget" not in doc["budget"]


def test_the_operator_mirrors_the_budget_in_force_in_either_mode():
    from stallfree.operator.status import Observed, status_patch

    o = Observed(generation=1, desired=1, replicas=1, ready=1, updated=1, workloads_current=True)
    time_mode = status_patch(o, {}, 2048, 0.8)["budget"]
    assert time_mode == {"mode": "time", "tokenBudget": 2048, "timeTarget": 0.8}
    assert "budget" not in status_patch(o, {"budget": time_mode}, 2048, 0.8)  # steady: no write
    back = status_patch(o, {"budget": {**time_mode, "lastDecision": "lower"}}, 512)["budget"]
    assert back == {"mode": "tokens", "tokenBudget": 512, "timeTarget": None, "lastDecision": "lower"}
