"""The Prometheus side against a real Prometheus scraping an exporter with the engine's metric names."""

from __future__ import annotations

import socket
import threading

import pytest
from controller_factories import make_config, make_specs
from fake_engine import FakeEngine
from promserver import PrometheusServer, available

from stallfree.operator.controller.loop import ControlLoop
from stallfree.operator.controller.prometheus import MetricsUnavailable, PrometheusSource
from stallfree.operator.controller.types import HOLD, LOWER
from stallfree.operator.status import controller_status

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not available(), reason="needs the prometheus binary (scripts/bootstrap --test)"),
]


@pytest.fixture(scope="module")
def fleet():
    engine = FakeEngine(clusters=("chat", "summarization", "cached"))
    engine.cached_share["cached"] = 0.75  # a shared system prompt: 3/4 of its prompt tokens hit the cache
    prom = PrometheusServer().start()
    prom.set_targets([engine.target])
    prom.wait_for(
        "histogram_quantile(0.99, sum by (le) (rate(stallfree_time_between_tokens_seconds_bucket[5s])))",
        pred=lambda rows: rows and rows[0]["value"][1] != "NaN",
    )
    yield engine, prom
    prom.close()
    engine.close()


def test_snapshot_reads_every_signal(fleet):
    engine, prom = fleet
    src = PrometheusSource(prom.url, 'job="stallfree"')
    snap = src.snapshot(5, ["chat", "summarization", "absent"])
    assert snap.replicas_seen == 1
    chat = snap.cluster("chat")
    assert 0.025 < chat.tbt_p99 <= 0.075  # observed 0.05s, bucket-interpolated
    assert 0.25 < chat.ttft_p99 <= 0.75
    assert 0.05 < chat.scheduling_delay_p50 <= 0.1
    assert chat.running == 4 and chat.waiting == 1
    assert 0.1 < chat.arrival_rate < 2 and 10 < chat.prefill_token_rate < 200
    assert 50 < chat.mean_context < 150
    # prefix caching: the feed-forward's demand is the uncached quarter; the context stays the whole prompt
    cached = src.snapshot(5, ["cached"]).cluster("cached")
    assert 50 < cached.mean_context < 150
    uncached_share = cached.prefill_token_rate / (cached.mean_context * cached.arrival_rate)
    assert 0.2 < uncached_share < 0.3
    absent = snap.cluster("absent")
    assert absent.tbt_p99 is None and absent.arrival_rate == 0  # no traffic is not missing data
    assert src.last_replicas and src.last_replicas[0].instance == engine.target
    assert snap.cost_model_error == pytest.approx(0.12)  # the P95 series, not the median


def test_the_cost_model_error_is_the_worst_engines(fleet):
    engine, prom = fleet
    other = FakeEngine(clusters=("chat",))
    other.cal_error.labels("0.95").set(0.8)
    try:
        prom.set_targets([engine.target, other.target])
        prom.wait_for(
            "count(stallfree_cost_model_error_ratio)", pred=lambda rows: rows and rows[0]["value"][1] == "4"
        )
        snap = PrometheusSource(prom.url, 'job="stallfree"').snapshot(5, ["chat"])
        assert snap.cost_model_error == pytest.approx(0.8) and snap.replicas_seen == 2
        only = PrometheusSource(prom.url, f'job="stallfree",instance="{engine.target}"').snapshot(5, ["chat"])
        assert only.cost_model_error == pytest.approx(0.12)  # the fleet selector applies to it too
    finally:
        prom.set_targets([engine.target])
        other.close()


def test_no_engine_for_selector_is_unavailable(fleet):
    _, prom = fleet
    with pytest.raises(MetricsUnavailable, match="no engine metrics"):
        PrometheusSource(prom.url, 'job="nobody"').snapshot(5, ["chat"])


def test_tbt_violation_lowers_budget_then_prometheus_down_holds(fleet):
    engine, prom = fleet
    engine.latency["chat"]["tbt"] = 0.25  # 2.5x the chat SLO of 0.1s
    prom.wait_for(
        'histogram_quantile(0.99, sum by (le) (rate(stallfree_time_between_tokens_seconds_bucket{traffic_cluster="chat"}[3s])))',
        pred=lambda rows: rows and float(rows[0]["value"][1]) > 0.15,
    )
    applied = []
    loop = ControlLoop.start(
        make_specs(), make_config(), 1024, 1,
        source=PrometheusSource(prom.url, 'job="stallfree"'), apply=applied.append, window_s=3, min_window_s=3,
    )  # fmt: skip
    loop.state = loop.state.__class__()  # no start-up cooldown for this test
    step = loop.step()
    assert step.action == LOWER and loop.settings.token_budget < 1024, step.reason
    assert applied and applied[-1].token_budget == loop.settings.token_budget
    tuned = loop.settings
    prom.stop()
    try:
        step = loop.step()
        assert step.action == HOLD and step.holding and loop.settings == tuned
        status = controller_status(loop)
        cond = {c["type"]: c for c in status["conditions"]}
        assert cond["MetricsAvailable"]["status"] == "False"
        assert "Prometheus" in cond["MetricsAvailable"]["message"]
        assert status["budget"]["tokenBudget"] == tuned.token_budget
    finally:
        prom.start()
        engine.latency["chat"]["tbt"] = 0.05


def test_a_hung_prometheus_costs_one_timeout_not_four():
    """A Prometheus that accepts and never answers: the query fails after its one timeout. The client's
    default retries (3, with backoff) would hold a controller step, and a deletion behind it, 4x as long."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        source = PrometheusSource(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=1.0)
        with pytest.raises(MetricsUnavailable, match="did not answer"):
            source.query("up")
        assert len(held) == 1
    finally:
        server.close()
        for conn in held:
            conn.close()
