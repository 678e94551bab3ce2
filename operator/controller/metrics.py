"""The controller's own Prometheus metrics (local mode's /metrics): what it decided and whether it holds.

Attach with `loop.observers.append(ControllerMetrics().observe)`. Its own registry, so several loops (tests)
do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from stallfree.operator.controller.loop import Step


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        lab = ["traffic_cluster"]
        self.decisions = Counter(
            "stallfree_controller_decisions",
            "Controller decisions by traffic cluster and action",
            [*lab, "action"],
            registry=r,
        )
        self.holding = Gauge(
            "stallfree_controller_holding", "1 while settings are held for missing metrics", registry=r
        )
        self.budget = Gauge(
            "stallfree_controller_token_budget", "Token budget the controller set", registry=r
        )
        self.replicas = Gauge("stallfree_controller_replicas", "Replicas the controller wants", registry=r)
        self.time_target = Gauge(
            "stallfree_controller_time_target_ratio",
            "Time target the controller set (share of the strictest P99 TBT SLO; 0 = tokens mode)",
            registry=r,
        )
        self.chunk_cap = Gauge(
            "stallfree_controller_chunk_cap_tokens", "Chunk cap the controller set", lab, registry=r
        )
        self.max_waiting = Gauge(
            "stallfree_controller_max_waiting", "Queue bound the controller set", lab, registry=r
        )
        self.slo_met = Gauge(
            "stallfree_controller_slo_met", "1 when the cluster met its SLOs last interval", lab, registry=r
        )

    def observe(self, step: Step) -> None:
        self.holding.set(1 if step.holding else 0)
        self.budget.set(step.settings.token_budget)
        self.replicas.set(step.settings.replicas)
        self.time_target.set(step.settings.time_target or 0.0)
        for name, knobs in step.settings.clusters.items():
            if knobs.chunk_cap is not None:
                self.chunk_cap.labels(name).set(knobs.chunk_cap)
            if knobs.max_waiting is not None:
                self.max_waiting.labels(name).set(knobs.max_waiting)
        actions = (
            step.decision.cluster_actions
            if step.decision
            else {n: step.action for n in step.settings.clusters}
        )
        for name, action in actions.items():
            self.decisions.labels(name, action).inc()
        for name, met in step.slo_met.items():
            self.slo_met.labels(name).set(1 if met else 0)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
