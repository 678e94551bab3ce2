"""The engine config (ConfigMap keys engine.yaml and, in time mode with a profile, cost_model.json) and the
admin-token Secret."""

from __future__ import annotations

import copy
import json

import yaml

from stallfree.operator.builders.meta import (
    CONFIG_KEY,
    COST_MODEL_KEY,
    BuildContext,
    Owner,
    admin_secret_name,
    config_map_name,
    metadata,
)

DEFAULT_CLUSTER = "default"


def _slo_dict(ctx: BuildContext) -> dict[str, float]:
    return ctx.spec.slo.to_json()


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
    """The iteration budget engines start with. Tokens mode: the controller's value (kept inside [min,
    max]) or spec.budget.initial. Time mode: spec.budget.max, the cap of an iteration."""
    b = ctx.spec.budget
    if ctx.spec.time_target is not None:
        return b.max
    if tuned and ctx.tuned.token_budget is not None:
        return max(b.min, min(b.max, ctx.tuned.token_budget))
    return b.initial_tokens


def time_target(ctx: BuildContext, *, tuned: bool = True) -> float | None:
    """Time mode: the time target engines start with, the controller's value (never above the spec's) or
    spec.budget.timeTarget; None in tokens mode."""
    spec_target = ctx.spec.time_target
    if spec_target is None:
        return None
    if tuned and ctx.tuned.time_target is not None and ctx.tuned.time_target > 0:
        return min(spec_target, ctx.tuned.time_target)
    return spec_target


def engine_config(ctx: BuildContext, *, tuned: bool = True) -> dict:
    """The document the engine reads from --traffic-clusters (see the engine contract in docs/operator.md):
    tokenBudget, in time mode timeTarget, and the traffic clusters."""
    doc: dict = {"tokenBudget": token_budget(ctx, tuned=tuned)}
    target = time_target(ctx, tuned=tuned)
    if target is not None:
        doc["timeTarget"] = target
    doc["trafficClusters"] = traffic_clusters(ctx, tuned=tuned)
    return doc


def cost_model_document(ctx: BuildContext) -> dict | None:
    """Time mode with spec.controller.costModel: the profile as a cost_model.json the engine reads with
    --cost-model (the prior its calibration starts from); None otherwise."""
    cm = ctx.spec.controller.cost_model
    if ctx.spec.time_target is None or cm is None:
        return None
    return {"coefficients": cm.coefficients()}


def render_engine_config(ctx: BuildContext, *, tuned: bool = True) -> str:
    return yaml.safe_dump(engine_config(ctx, tuned=tuned), sort_keys=False, default_flow_style=False)


def build_config_map(ctx: BuildContext) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx.owner, config_map_name(ctx.owner), "config"),
        "data": {CONFIG_KEY: render_engine_config(ctx), **_cost_model_data(ctx)},
    }


def _cost_model_data(ctx: BuildContext) -> dict[str, str]:
    doc = cost_model_document(ctx)
    return {} if doc is None else {COST_MODEL_KEY: json.dumps(doc, indent=2, sort_keys=True) + "\n"}


def build_admin_secret(owner: Owner, token: str) -> dict:
    """The Secret holding the admin API bearer token (created once, never rewritten: the token is random)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, admin_secret_name(owner), "admin-token"),
        "type": "Opaque",
        "stringData": {"token": token},
    }
