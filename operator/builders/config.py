"""The engine config (ConfigMap key engine.yaml) and the admin-token Secret."""

from __future__ import annotations

import copy

import yaml

from stallfree.operator.builders.meta import (
    CONFIG_KEY,
    BuildContext,
    Owner,
    admin_secret_name,
    config_map_name,
    metadata,
)

DEFAULT_CLUSTER = "default"


def _slo_dict(ctx: BuildContext) -> dict[str, float]:
    slo = ctx.spec.slo
    return {
        "ttftP99Seconds": slo.ttft_p99_seconds,
        "tbtP99Seconds": slo.tbt_p99_seconds,
        "schedulingDelayP50Seconds": slo.scheduling_delay_p50_seconds,
    }


def traffic_clusters(ctx: BuildContext, *, tuned: bool = True) -> list[dict]:
    """The CR's spec.trafficClusters items as written, with missing SLOs taken from spec.slo, missing
    admission limits from spec.admission, and (tuned=True) the knobs the budget controller set on top.
    No clusters in the spec means one cluster named "default" that takes every request."""
    raw = ctx.raw_spec.get("trafficClusters") or [{"name": DEFAULT_CLUSTER, "priority": 0}]
    admission = ctx.spec.admission
    out = []
    for item in raw:
        c = copy.deepcopy(item)
        c["slo"] = {**_slo_dict(ctx), **(item.get("slo") or {})}
        c.setdefault("maxWaiting", admission.max_waiting)
        if admission.max_running is not None:
            c.setdefault("maxRunning", admission.max_running)
        if tuned:
            c.update(ctx.tuned.clusters.get(c["name"], {}))
        out.append(c)
    return out


def token_budget(ctx: BuildContext, *, tuned: bool = True) -> int:
    """The iteration budget engines start with: the controller's value (kept inside [min, max]) or
    spec.budget.initial."""
    b = ctx.spec.budget
    if tuned and ctx.tuned.token_budget is not None:
        return max(b.min, min(b.max, ctx.tuned.token_budget))
    return b.initial


def engine_config(ctx: BuildContext, *, tuned: bool = True) -> dict:
    """The document the engine reads from --traffic-clusters (see the engine contract in docs/operator.md)."""
    return {
        "tokenBudget": token_budget(ctx, tuned=tuned),
        "trafficClusters": traffic_clusters(ctx, tuned=tuned),
    }


def render_engine_config(ctx: BuildContext, *, tuned: bool = True) -> str:
    return yaml.safe_dump(engine_config(ctx, tuned=tuned), sort_keys=False, default_flow_style=False)


def build_config_map(ctx: BuildContext) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx.owner, config_map_name(ctx.owner), "config"),
        "data": {CONFIG_KEY: render_engine_config(ctx)},
    }


def build_admin_secret(owner: Owner, token: str) -> dict:
    """The Secret holding the admin API bearer token (created once, never rewritten: the token is random)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, admin_secret_name(owner), "admin-token"),
        "type": "Opaque",
        "stringData": {"token": token},
    }
