"""Every Grafana panel query and every alert expression, run against a real Prometheus that scrapes an
exporter with the engine's metric names and the controller's own metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from fake_engine import FakeEngine
from prometheus_client import start_http_server
from promserver import PrometheusServer, available, free_port

from stallfree.operator.controller.loop import Step
from stallfree.operator.controller.metrics import ControllerMetrics
from stallfree.operator.controller.types import LOWER, Knobs, Settings

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not available(), reason="needs the prometheus binary (scripts/bootstrap --test)"),
]
CHART = Path(__file__).resolve().parents[2] / "charts" / "stallfree"
DASHBOARD = CHART / "dashboards" / "stallfree.json"
ALERTS = CHART / "dashboards" / "alerts.yaml"
# Grafana's variables, as the dashboard's "All" would expand them.
VARIABLES = {"$__rate_interval": "10s", "$namespace": ".*", "$deployment": ".*"}


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p["targets"]:
            expr = t["expr"]
            for k, v in VARIABLES.items():
                expr = expr.replace(k, v)
            out.append((f"{p['title']} / {t['legendFormat']}", expr))
    return out


@pytest.fixture(scope="module")
def prom():
    engine = FakeEngine()
    metrics = ControllerMetrics()
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    s = Settings(384, 1, {"chat": Knobs(384, 64, 16), "summarization": Knobs(256, 16, 8)})
    metrics.observe(Step(time.time(), s, LOWER, "test", None, False))
    p = PrometheusServer()
    p.rule_files = [str(ALERTS)]
    p.start()
    p.set_targets([engine.target, f"127.0.0.1:{port}"], {"namespace": "llm", "service": "smollm2"})
    p.wait_for("stallfree_controller_holding")
    p.wait_for("rate(stallfree_time_between_tokens_seconds_bucket[10s])")
    time.sleep(3)  # a few scrapes, so rate() windows hold two samples or more
    yield p
    p.close()
    server.shutdown()
    engine.close()


def test_dashboard_is_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    titles = " ".join(p["title"] for p in dash["panels"])
    for needed in (
        "time between tokens",
        "time to first token",
        "budget",
        "decisions",
        "Queue",
        "Goodput",
        "KV",
        "Iteration",
    ):
        assert needed.lower() in titles.lower(), needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("title,expr", panel_queries(), ids=[t for t, _ in panel_queries()])
def test_panel_query_returns_data(prom, title, expr):
    doc = prom.query(expr)
    assert doc["status"] == "success", doc
    rows = doc["data"]["result"]
    # Every panel has data here: the exporter emits every engine series, and the controller one decision.
    assert rows, f"{title}: no data for {expr}"


def test_alert_rules_load_and_evaluate(prom):
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    names = {r["alert"] for g in groups for r in g["rules"]}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        loaded = prom.rules()["data"]["groups"]
        rules = [r for g in loaded for r in g["rules"]]
        if {r["name"] for r in rules} == names and all(
            r.get("lastEvaluation", "").startswith("2") and r["health"] != "unknown" for r in rules
        ):
            break
        time.sleep(1)
    assert {r["name"] for r in rules} == names
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad, bad


@pytest.mark.parametrize(
    "alert,expect_rows",
    [
        ("StallfreeTBTSLOFastBurn", False),  # fake TBT 50ms under the 100ms SLO: valid and empty
        ("StallfreeTTFTSLOFastBurn", False),
        ("StallfreeControllerHolding", False),
        ("StallfreeRequestsRejected", False),
        ("StallfreeEngineMetricsMissing", False),
        ("StallfreeCostModelMiscalibrated", False),  # fake P95 error 0.12, under the 0.5 limit
    ],
)
def test_alert_expression_runs(prom, alert, expect_rows):
    rule = next(
        r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if r["alert"] == alert
    )
    doc = prom.query(rule["expr"].replace("[5m]", "[10s]").replace("[1h]", "[10s]"))
    assert doc["status"] == "success", doc
    assert bool(doc["data"]["result"]) == expect_rows, doc["data"]["result"]


def test_tbt_burn_alert_fires_on_a_violation(prom):
    """With the chat SLO tightened below what is observed, the burn expression returns that cluster."""
    rule = next(
        r
        for g in yaml.safe_load(ALERTS.read_text())["groups"]
        for r in g["rules"]
        if r["alert"] == "StallfreeTBTSLOFastBurn"
    )
    expr = (
        rule["expr"]
        .replace("[5m]", "[10s]")
        .replace(
            "max by (namespace, service, traffic_cluster) (stallfree_slo_tbt_p99_seconds)",
            "max by (namespace, service, traffic_cluster) (stallfree_slo_tbt_p99_seconds) * 0.1",
        )
    )
    rows = prom.query(expr)["data"]["result"]
    assert {r["metric"]["traffic_cluster"] for r in rows} == {"chat", "summarization"}
