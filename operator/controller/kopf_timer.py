"""The budget controller inside the operator: one kopf timer per SarathiDeployment.

Every `spec.controller.intervalSeconds` the timer reads the fleet's metrics from Prometheus, decides, and
- PATCHes /admin/v1/config on every running engine pod that does not run the settings yet (the change
  takes effect next iteration; a hold writes nothing),
- writes the tuned values to status (status.budget, status.trafficClusters[], status.desiredReplicas and
  the SLOMet / MetricsAvailable conditions) — never to spec, so GitOps tools see no drift,
- re-applies the children, so the ConfigMap's engine.yaml carries the tuned values (a restarted pod comes
  back tuned) and the Deployment the chosen replica count,
- posts a Kubernetes Event per change and a Warning when it starts holding settings (explicitly: kopf
  does not turn handler log lines into Events unless settings.posting.loggers is on, and it is off).

Register on the operator's registry with `register(registry, config)` (stallfree.operator.handlers).
This is the only controller module that imports kopf.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kopf

from stallfree.operator.builders.meta import Owner, admin_secret_name, selector_string
from stallfree.operator.controller.applier import EngineApplier, Target, Targets
from stallfree.operator.controller.config import loop_inputs
from stallfree.operator.controller.loop import ControlLoop
from stallfree.operator.controller.prometheus import PrometheusSource
from stallfree.operator.controller.types import HOLD, Knobs, Settings
from stallfree.operator.reconcile import OperatorConfig, Reconciler
from stallfree.operator.spec import GROUP, PLURAL, VERSION, SarathiSpec, parse_spec
from stallfree.operator.status import controller_status, merge_conditions

log = logging.getLogger(__name__)
TICK_SECONDS = 5.0  # the kopf timer's period; each resource acts on its own spec.controller.intervalSeconds

EventPoster = Callable[[str, str, str], None]  # (type "Normal" | "Warning", reason, message)


def no_events(type_: str, reason: str, message: str) -> None:
    """The EventPoster outside an operator (tests): kopf can only post Events from inside one."""


def fleet_selector(namespace: str, name: str) -> str:
    """Label matchers of the engine series: the ServiceMonitor targets the Service named after the CR."""
    return f'namespace="{namespace}",service="{name}"'


def settings_from_status(status: dict | None, replicas: int, fallback: Settings) -> Settings:
    """The settings in force according to status (written by an earlier controller run): a restarted
    operator continues from them instead of jumping back to spec.budget.initial."""
    status = status or {}
    doc = status.get("budget") or {}
    mode = doc.get("mode")  # what they were tuned in: after a change of mode, the spec's start again
    budget = doc.get("tokenBudget") if mode != "time" else None
    target = doc.get("timeTarget") if mode != "tokens" else None
    clusters = dict(fallback.clusters)
    for item in status.get("trafficClusters") or []:
        if item.get("name") in clusters:
            clusters[item["name"]] = Knobs(
                item.get("chunkCap"), item.get("maxWaiting"), item.get("maxRunning")
            )
    return Settings(
        token_budget=int(budget) if budget else fallback.token_budget,
        replicas=int(status.get("desiredReplicas") or replicas),
        clusters=clusters,
        time_target=float(target) if target else fallback.time_target,
    )


def pod_targets(kube: Any, namespace: str, name: str, port: int) -> Targets:
    """The Running engine pods of one SarathiDeployment, as the applier's targets. A pod is remembered by
    its uid, IP and container restarts: a restarted engine reads engine.yaml again and is sent the
    settings again."""

    def targets() -> list[Target]:
        out = []
        for pod in kube.list("v1", "Pod", namespace, selector_string_for(name)):
            st = pod.get("status") or {}
            ip = st.get("podIP")
            if st.get("phase") != "Running" or not ip:
                continue
            host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP needs brackets in a URL
            meta = pod["metadata"]
            restarts = sum(int(c.get("restartCount") or 0) for c in st.get("containerStatuses") or [])
            key = f"{meta.get('uid') or meta['name']}/{ip}/{restarts}"
            out.append(Target(f"http://{host}:{port}", meta["name"], key))
        return out

    return targets


def admin_token(kube: Any, namespace: str, name: str, spec: SarathiSpec) -> Callable[[], str | None]:
    """Looks up the engines' admin token in its Secret (spec.engine.adminTokenSecret, else the one the
    operator made) when the applier has something to send."""
    ref = spec.engine.admin_token_secret

    def token() -> str | None:
        secret = kube.get("v1", "Secret", namespace, ref.name if ref else admin_secret_name_for(name))
        if not secret:
            return None
        raw = (secret.get("data") or {}).get(ref.key if ref else "token")
        return base64.b64decode(raw).decode() if raw else None

    return token


def pod_applier(reconciler: Reconciler, namespace: str, name: str, spec: SarathiSpec) -> EngineApplier:
    """The applier of one SarathiDeployment: its Running pods, its admin token."""
    kube = reconciler.kube
    return EngineApplier(
        pod_targets(kube, namespace, name, spec.engine.port), admin_token(kube, namespace, name, spec)
    )


def admin_secret_name_for(name: str) -> str:
    return admin_secret_name(Owner(name, "", ""))


def selector_string_for(name: str) -> str:
    return selector_string(Owner(name, "", ""))


@dataclass
class _Slot:
    """One resource's loop, rebuilt when its spec generation changes."""

    generation: int
    loop: ControlLoop
    next_at: float


def step_resource(
    body: dict,
    patch: Any,
    logger: Any,
    memo: Any,
    config: OperatorConfig,
    now: float | None = None,
    post_event: EventPoster = no_events,
) -> dict | None:
    """One timer tick for one SarathiDeployment; returns the status patch written (None when idle).
    `post_event` posts Kubernetes Events on the SarathiDeployment (see register)."""
    spec = parse_spec(body.get("spec") or {})
    if not spec.controller.enabled:
        return None
    meta = body["metadata"]
    ns, name, gen = meta["namespace"], meta["name"], meta.get("generation", 1)
    now = time.monotonic() if now is None else now
    slot: _Slot | None = getattr(memo, "budget_controller", None)
    url = spec.controller.prometheus_url or config.prometheus_url
    if not url:
        cond = {"type": "MetricsAvailable", "status": "False", "reason": "NoPrometheus",
                "message": "set spec.controller.prometheusUrl or the operator's --prometheus-url"}  # fmt: skip
        have = (body.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "MetricsAvailable" and c.get("reason") == "NoPrometheus" for c in have):
            return None  # said already: no status write every tick
        doc = {"conditions": merge_conditions(have, [cond])}
        patch.status.update(doc)
        return doc
    if slot is None or slot.generation != gen:
        inp = loop_inputs(spec)
        loop = ControlLoop.start(
            inp.specs, inp.config, inp.initial_budget, inp.initial_replicas,
            source=PrometheusSource(url, fleet_selector(ns, name), max_age_s=max(30.0, 3 * inp.interval_s)),
            apply=pod_applier(memo.reconciler, ns, name, spec), window_s=inp.window_s,
            min_window_s=min(inp.window_s, max(10.0, 2 * inp.interval_s)), model=inp.model,
        )  # fmt: skip
        loop.adopt(settings_from_status(body.get("status"), spec.replica_count(), loop.settings))
        slot = _Slot(gen, loop, now)
        memo.budget_controller = slot
    if now < slot.next_at:
        return None
    slot.next_at = now + spec.controller.interval_seconds
    was_holding = slot.loop.holding is not None
    step = slot.loop.step()
    doc = controller_status(slot.loop)
    before = (body.get("status") or {}).get("conditions")
    doc["conditions"] = merge_conditions(before, doc["conditions"])
    patch.status.update(doc)
    miscalibrated = _newly_false(before, doc["conditions"], "CostModelCalibrated")
    if miscalibrated is not None:  # one Warning when the engines' predictions go off, not one per tick
        logger.warning("%s", miscalibrated)
        post_event("Warning", "CostModelMiscalibrated", miscalibrated)
    if step.action != HOLD:
        message = f"budget controller: {step.action} ({step.reason})"
        logger.info("%s", message)
        post_event("Normal", "Tuned", message)

        def record(reason: str, change: str) -> None:  # one child re-applied ("updated ConfigMap x")
            logger.info("%s", change)
            post_event("Normal", reason, change)

        # engine.yaml in the ConfigMap and the Deployment's replicas follow status: apply them now.
        new_body = {**body, "status": {**(body.get("status") or {}), **doc}}
        memo.reconciler.apply_children(memo.reconciler.context(new_body), record)
    elif step.holding:
        message = f"budget controller holding settings: {step.reason}"
        logger.warning("%s", message)
        if not was_holding:  # one Warning when holding starts, not one per tick while it lasts
            post_event("Warning", "HoldingSettings", message)
    return doc


def _newly_false(before: list[dict] | None, after: list[dict], ctype: str) -> str | None:
    """The message of condition `ctype` when it turned False with this update; None otherwise."""
    old = next((c for c in before or [] if c.get("type") == ctype), None)
    new = next((c for c in after if c.get("type") == ctype), None)
    if new is None or new.get("status") != "False" or (old is not None and old.get("status") == "False"):
        return None
    return str(new.get("message", ""))


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Add the budget controller's timer to the operator's registry."""

    @kopf.timer(
        GROUP, VERSION, PLURAL, registry=registry, id="budget-controller",
        interval=TICK_SECONDS, initial_delay=TICK_SECONDS, idle=None,
    )  # fmt: skip
    def budget_controller(body: kopf.Body, patch: kopf.Patch, logger: Any, memo: kopf.Memo, **_: Any) -> None:
        def post_event(type_: str, reason: str, message: str) -> None:
            post = kopf.warn if type_ == "Warning" else kopf.info
            post(body, reason=reason, message=message)

        try:
            step_resource(dict(body), patch, logger, memo, config, post_event=post_event)
        except ValueError as e:  # the reconcile handler reports invalid specs
            logger.debug("budget controller skipped: %s", e)
