"""Pure status computation: the SarathiDeployment status patch, from what the reconciler saw of the
children (the operator's fields) and from the budget controller's last step (its fields, the same
document in local mode's /admin/v1/status)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallfree.operator.controller.loop import ControlLoop

from stallfree.operator.model_status import WAITING_REASONS

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"


@dataclass(frozen=True, slots=True)
class Observed:
    """What the reconciler saw of the children."""

    generation: int
    desired: int  # replicas wanted
    replicas: int  # replicas that exist
    ready: int  # replicas whose every pod is ready
    updated: int  # replicas already on the current pod template
    workloads_current: bool  # every workload controller has seen its latest spec
    unschedulable: tuple[str, ...] = ()  # scheduler messages of pods that cannot be placed
    failing: tuple[str, ...] = ()  # container problems (CrashLoopBackOff, ImagePullBackOff, ...)
    deadline_exceeded: str | None = None  # the Deployment's ProgressDeadlineExceeded message
    model_ready: dict | None = None  # the ModelReady condition (stallfree.operator.model_status)
    extra: dict = field(default_factory=dict)  # e.g. endpoint, selector


def _now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int) -> dict:
    return {
        "type": ctype,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def _model_fault(o: Observed) -> dict | None:
    """ModelReady when it says the model cannot be had (not merely: not yet)."""
    m = o.model_ready
    return m if m and m["status"] == "False" and m["reason"] not in WAITING_REASONS else None


def conditions_for(o: Observed) -> list[dict]:
    """Ready, Progressing, Degraded and ModelReady for one observation (lastTransitionTime is added by
    merge)."""
    g = o.generation
    problems = [*o.unschedulable, *o.failing] + ([o.deadline_exceeded] if o.deadline_exceeded else [])
    model_fault = _model_fault(o)
    if model_fault:
        problems.insert(0, model_fault["message"])
        degraded = _condition(DEGRADED, True, model_fault["reason"], model_fault["message"], g)
    elif o.unschedulable:
        degraded = _condition(
            DEGRADED, True, "Unschedulable", "engine pods cannot be scheduled: " + o.unschedulable[0], g
        )
    elif o.failing:
        degraded = _condition(DEGRADED, True, "PodsFailing", o.failing[0], g)
    elif o.deadline_exceeded:
        degraded = _condition(DEGRADED, True, "ProgressDeadlineExceeded", o.deadline_exceeded, g)
    else:
        degraded = _condition(DEGRADED, False, "AsExpected", "no problems seen", g)

    done = o.workloads_current and o.updated >= o.desired and o.ready >= o.desired and o.replicas <= o.desired
    if done:
        progressing = _condition(
            PROGRESSING, False, "RolloutComplete", f"{o.ready}/{o.desired} replicas ready", g
        )
    else:
        why = "WaitingForGPUs" if o.unschedulable else "RollingOut"
        detail = f"{o.updated}/{o.desired} replicas updated, {o.ready}/{o.desired} ready"
        progressing = _condition(PROGRESSING, True, why, detail + (f"; {problems[0]}" if problems else ""), g)

    if o.desired == 0:
        ready = _condition(READY, True, "ScaledToZero", "no replicas wanted", g)
    elif o.ready >= o.desired and o.workloads_current:
        ready = _condition(READY, True, "AllReplicasReady", f"{o.ready}/{o.desired} replicas ready", g)
    else:
        ready = _condition(READY, False, "ReplicasNotReady", f"{o.ready}/{o.desired} replicas ready", g)
    return [ready, progressing, degraded] + ([o.model_ready] if o.model_ready else [])


def merge_conditions(old: list[dict] | None, new: list[dict], now: str | None = None) -> list[dict]:
    """New conditions replace old ones of the same type, keeping lastTransitionTime when the status did
    not change; conditions of other types (SLOMet, written by the budget controller) are kept."""
    now = now or _now()
    by_type = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = by_type.pop(c["type"], None)
        if prev is not None and prev.get("status") == c["status"] and prev.get("lastTransitionTime"):
            since = prev["lastTransitionTime"]  # status unchanged: keep when it last moved
        else:
            since = now
        out.append({**c, "lastTransitionTime": since})
    out.extend(c for c in by_type.values() if c.get("type"))
    return out


def phase_of(conditions: list[dict]) -> str:
    status = {c["type"]: c["status"] for c in conditions}
    if status.get(DEGRADED) == "True":
        return "Degraded"
    if status.get(READY) == "True" and status.get(PROGRESSING) != "True":
        return "Ready"
    return "Progressing"


def status_patch(
    o: Observed, old_status: dict | None, token_budget: int, time_target: float | None = None
) -> dict:
    """The status fields the operator owns. Budget-controller fields (trafficClusters, budget decisions,
    desiredReplicas, SLOMet) are left as they are, except that status.budget always shows the budget in
    force: its mode, tokenBudget (the controller's once it decided, else spec.budget.initial; in time mode
    the cap) and in time mode timeTarget (the controller's, else spec.budget.timeTarget)."""
    old_status = old_status or {}
    conditions = merge_conditions(old_status.get("conditions"), conditions_for(o))
    patch = {
        "observedGeneration": o.generation,
        "replicas": o.replicas,
        "readyReplicas": o.ready,
        "phase": phase_of(conditions),
        "conditions": conditions,
        **o.extra,
    }
    budget = dict(old_status.get("budget") or {})
    in_force: dict = {"mode": "tokens" if time_target is None else "time", "tokenBudget": token_budget}
    if time_target is not None:
        in_force["timeTarget"] = time_target
    elif "timeTarget" in budget:
        in_force["timeTarget"] = None  # back in tokens mode: a merge patch removes it
    if any(budget.get(k) != v for k, v in in_force.items()):
        patch["budget"] = {**budget, **in_force}
    return patch


def differs(old_status: dict | None, patch: dict) -> bool:
    """Whether applying `patch` would change the status (so a steady fleet causes no writes)."""
    old_status = old_status or {}
    return any(old_status.get(k) != v for k, v in patch.items())


# ---- the budget controller's fields ------------------------------------------------------------------------
def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def controller_status(loop: ControlLoop) -> dict:
    """status.budget, status.desiredReplicas, status.trafficClusters[] and the controller's conditions
    (MetricsAvailable, SettingsApplied, SLOMet) for the settings in force and the loop's last step."""
    step = loop.last
    snap = step.snapshot if step else None
    s = loop.settings
    when = _iso(step.time) if step else None
    clusters = []
    all_met: bool | None = None
    worst_tbt: float | None = None
    for spec in loop.specs:
        item: dict = {"name": spec.name, "tokenBudget": s.token_budget, **s.knobs(spec.name).as_engine()}
        if snap is not None:
            c = snap.cluster(spec.name)
            obs = {
                "observedTtftP99Seconds": c.ttft_p99,
                "observedTbtP99Seconds": c.tbt_p99,
                "observedSchedulingDelayP50Seconds": c.scheduling_delay_p50,
            }
            item.update({k: round(v, 4) for k, v in obs.items() if v is not None})
            item["queueLength"] = round(c.waiting, 2)
            item["arrivalRate"] = round(c.arrival_rate, 3)
            met = spec.slo.met(c)
            if met is not None:
                item["sloMet"] = met
                all_met = met if all_met is None else (all_met and met)
            if c.tbt_p99 is not None:
                worst_tbt = max(worst_tbt or 0.0, c.tbt_p99)
        if step and step.decision:
            item["lastDecision"] = step.decision.cluster_actions.get(spec.name, step.action)
            item["reason"] = step.decision.cluster_reasons.get(spec.name, step.reason)
        elif step:
            item["lastDecision"], item["reason"] = step.action, step.reason
        if when:
            item["lastDecisionTime"] = when
        clusters.append(item)
    budget = budget_in_force(loop)
    if worst_tbt is not None:
        budget["observedTbtP99Seconds"] = round(worst_tbt, 4)
    if step:
        budget.update(lastDecision=step.action, lastDecisionTime=when, reason=step.reason)
    return {
        "budget": budget,
        "desiredReplicas": s.replicas,
        "trafficClusters": clusters,
        "conditions": controller_conditions(loop, all_met),
    }


def budget_in_force(loop: ControlLoop) -> dict:
    """status.budget's settings: the mode, the token budget (time mode: the cap), the time target (time
    mode) and the engines' cost-model error last read (the worst engine's P95)."""
    s = loop.settings
    doc: dict = {
        "mode": "tokens" if loop.config.time_target is None else "time",
        "tokenBudget": s.token_budget,
    }
    if s.time_target is not None:
        doc["timeTarget"] = s.time_target
    snap = loop.last.snapshot if loop.last else None
    if snap is not None and snap.cost_model_error is not None:
        doc["costModelErrorP95"] = round(snap.cost_model_error, 4)
    return doc


def _controller_condition(ctype: str, status: str, reason: str, message: str) -> dict:
    return {"type": ctype, "status": status, "reason": reason, "message": message}


def calibration_condition(loop: ControlLoop) -> dict:
    """CostModelCalibrated (time mode): whether the engines' cost model, which sizes every iteration to the
    time target, predicts iteration times within the controller's limit (P95 of |predicted / observed - 1|,
    the worst engine). While it does not, the controller never raises the time target."""
    snap = loop.last.snapshot if loop.last else None
    err = snap.cost_model_error if snap is not None else None
    limit = loop.config.calibration_limit
    if err is None:
        return _controller_condition(
            "CostModelCalibrated", "Unknown", "NoData", "the engines report no iteration predictions yet"
        )
    if err > limit:
        return _controller_condition(
            "CostModelCalibrated", "False", "Miscalibrated",
            f"the engines' cost model misses iteration times by {err:.2f} (P95 |predicted/observed - 1|, "
            f"worst engine; limit {limit:g}): the time target is not raised until it recovers",
        )  # fmt: skip
    return _controller_condition(
        "CostModelCalibrated", "True", "Calibrated",
        f"P95 |predicted/observed - 1| of iteration times {err:.2f} (worst engine; limit {limit:g})",
    )  # fmt: skip


def controller_conditions(loop: ControlLoop, all_met: bool | None) -> list[dict]:
    """MetricsAvailable, SettingsApplied and SLOMet (and in time mode CostModelCalibrated), stamped with
    the loop's clock (merge_conditions keeps the earlier lastTransitionTime of a condition whose status did
    not move)."""
    now = _iso(loop.clock())
    # Metrics read but the engines refused the settings: the data is fine, the apply is not; say so in its
    # own condition rather than blaming the metrics.
    if loop.holding and loop.apply_error is None:
        metrics = _controller_condition("MetricsAvailable", "False", "HoldingSettings", loop.holding)
    else:
        metrics = _controller_condition("MetricsAvailable", "True", "MetricsRead", "engine metrics are fresh")
    if loop.apply_error is not None:
        applied = _controller_condition(
            "SettingsApplied", "False", "ApplyFailed", f"holding last good settings: {loop.apply_error}"
        )
    else:
        applied = _controller_condition(
            "SettingsApplied", "True", "Applied", "every engine runs the settings in status"
        )
    if all_met is None:
        slo = _controller_condition("SLOMet", "Unknown", "NoData", "no traffic observed in the window")
    elif all_met:
        slo = _controller_condition("SLOMet", "True", "SLOsMet", "every traffic cluster met its SLOs")
    else:
        slo = _controller_condition("SLOMet", "False", "SLOViolated", loop.last.reason if loop.last else "")
    out = [metrics, applied, slo]
    if loop.config.time_target is not None:
        out.append(calibration_condition(loop))
    return [{**c, "lastTransitionTime": now} for c in out]
