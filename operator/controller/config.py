"""From a validated SarathiDeployment spec to the controller's inputs (cluster specs and loop bounds)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stallfree.costmodel.model import BUILTIN, CostModel, from_coefficients
from stallfree.operator.controller.types import ClusterSpec, ControllerConfig, Knobs
from stallfree.operator.spec import SarathiSpec

DEFAULT_CLUSTER = "default"  # what the engine config calls the one cluster of a spec without any


@dataclass(frozen=True, slots=True)
class LoopInputs:
    specs: tuple[ClusterSpec, ...]
    config: ControllerConfig
    interval_s: float
    window_s: float
    initial_budget: int  # tokens mode: spec.budget.initial; time mode: the cap, spec.budget.max
    initial_replicas: int
    model: CostModel = BUILTIN  # spec.controller.costModel's profile, else the built-in shape


def cluster_specs(spec: SarathiSpec) -> tuple[ClusterSpec, ...]:
    """Each traffic cluster with missing SLOs and admission limits filled in from spec.slo / spec.admission,
    exactly as the operator writes them into the engine config."""
    adm = spec.admission
    if not spec.traffic_clusters:
        knobs = Knobs(None, adm.max_waiting, adm.max_running)
        return (ClusterSpec(DEFAULT_CLUSTER, slo=spec.slo, knobs=knobs),)
    out = []
    for c in spec.traffic_clusters:
        slo = spec.cluster_slo(c)
        knobs = Knobs(
            chunk_cap=c.chunk_cap,
            max_waiting=c.max_waiting if c.max_waiting is not None else adm.max_waiting,
            max_running=c.max_running if c.max_running is not None else adm.max_running,
        )
        out.append(ClusterSpec(c.name, slo=slo, priority=c.priority, knobs=knobs))
    return tuple(out)


def raise_memory(window_s: float, interval_s: float) -> int:
    """Intervals of TBT history a raise must also have slack in: one metrics window plus one interval."""
    return math.ceil(window_s / interval_s) + 1


def loop_inputs(spec: SarathiSpec, **overrides: float) -> LoopInputs:
    """Everything a ControlLoop needs from the spec; `overrides` replace ControllerConfig fields. Time mode
    (spec.time_target set): the loop tunes the time target, and the token budget stays the cap."""
    b, r, ctl = spec.budget, spec.replicas, spec.controller
    overrides.setdefault("raise_memory", raise_memory(ctl.window_seconds, ctl.interval_seconds))
    timed = spec.time_target is not None
    cfg = ControllerConfig(
        budget_min=b.min,
        budget_max=b.max,
        align=b.align,
        replicas_min=max(r.min, 1),
        replicas_max=max(r.max, 1),
        interval_s=float(ctl.interval_seconds),
        budget_home=None if timed else b.initial_tokens,
        time_target=spec.time_target,
        **overrides,
    )
    return LoopInputs(
        specs=cluster_specs(spec),
        config=cfg,
        interval_s=float(ctl.interval_seconds),
        window_s=float(ctl.window_seconds),
        initial_budget=b.max if timed else b.initial_tokens,
        initial_replicas=spec.replica_count(),
        model=BUILTIN if ctl.cost_model is None else from_coefficients(ctl.cost_model.coefficients()),
    )
