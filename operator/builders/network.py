"""Service, headless Service, PodDisruptionBudget and ServiceMonitor of a SarathiDeployment."""

from __future__ import annotations

from stallfree.operator.builders.meta import (
    BuildContext,
    headless_service_name,
    metadata,
    selector_labels,
)
from stallfree.operator.builders.workload import LWS_WORKER_INDEX_LABEL, STS_POD_INDEX_LABEL


def _leader_selector(ctx: BuildContext) -> dict[str, str]:
    """Pods that serve HTTP: all of them on one node; only rank 0 when a replica spans nodes."""
    sel = selector_labels(ctx.owner)
    if ctx.spec.multi_node:
        sel[LWS_WORKER_INDEX_LABEL if ctx.features.leader_worker_set else STS_POD_INDEX_LABEL] = "0"
    return sel


def build_service(ctx: BuildContext) -> dict:
    """The OpenAI-compatible endpoint (and /metrics) of the fleet."""
    port = ctx.spec.engine.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx.owner, ctx.owner.name),
        "spec": {
            "type": "ClusterIP",
            "selector": _leader_selector(ctx),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_headless_service(ctx: BuildContext) -> dict:
    """Stable DNS names for the pods of multi-node replicas (rank 0 is the rendezvous address)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx.owner, headless_service_name(ctx.owner)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # ranks must find each other before any is ready
            "selector": selector_labels(ctx.owner),
            "ports": [
                {"name": "http", "port": ctx.spec.engine.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_pdb(ctx: BuildContext) -> dict:
    """Voluntary disruptions (node drains) take at most one engine pod at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ctx.owner, ctx.owner.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(ctx.owner)}},
    }


def build_service_monitor(ctx: BuildContext) -> dict:
    """Prometheus Operator scrape config for the engines' /metrics (the budget controller reads them)."""
    interval = max(5, min(30, ctx.spec.controller.interval_seconds))
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata(ctx.owner, ctx.owner.name, "metrics"),
        "spec": {
            "selector": {"matchLabels": selector_labels(ctx.owner)},
            "namespaceSelector": {"matchNames": [ctx.owner.namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": f"{interval}s"}],
        },
    }
