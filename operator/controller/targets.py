"""Whom an admission change acts on: the cluster to shed, to throttle, to give back to, or to reopen.

Plain functions of the snapshot, the settings in force and the spec; the rules in `rules.py` decide when.
Shedding picks the lowest-priority cluster with traffic (most prefill tokens first among equals); giving
back picks the highest-priority shed cluster, its running cap before its queue bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from stallfree.operator.controller.types import (
    ClusterSnapshot,
    ClusterSpec,
    ControllerConfig,
    Settings,
    Snapshot,
)

DEFAULT_MAX_WAITING = 256  # what shedding starts from when neither settings nor spec bound a queue
DEFAULT_MAX_RUNNING = 256  # what a capped maxRunning is restored to when the spec sets none (>= maxNumSeqs)


def shed_target(
    snap: Snapshot, settings: Settings, specs: Sequence[ClusterSpec], cfg: ControllerConfig
) -> tuple[str, int] | None:
    """The lowest-priority cluster with traffic whose queue bound can still come down (most prefill
    tokens first among equals), and its new maxWaiting; None when nothing can be shed."""
    candidates = []
    for s in specs:
        c: ClusterSnapshot = snap.cluster(s.name)
        if c.arrival_rate <= 0 and c.waiting <= 0:
            continue
        current = settings.knobs(s.name).max_waiting
        if current is None:
            current = s.knobs.max_waiting if s.knobs.max_waiting is not None else DEFAULT_MAX_WAITING
        if current > cfg.min_max_waiting:
            candidates.append((s.priority, -c.prefill_token_rate, s.name, current))
    if not candidates:
        return None
    _, _, name, current = min(candidates)
    return name, max(cfg.min_max_waiting, current // 2)


def throttle_target(
    snap: Snapshot, settings: Settings, specs: Sequence[ClusterSpec]
) -> tuple[str, int] | None:
    """For TBT the budget cannot fix: the lowest-priority cluster with traffic, when it runs two or more
    requests per replica (or has that many under its cap), and a maxRunning of half of them; None
    otherwise (then its queue is shed instead)."""
    live = [
        s for s in specs if (c := snap.cluster(s.name)).arrival_rate > 0 or c.waiting > 0 or c.running > 0
    ]
    if not live:
        return None
    s = min(live, key=lambda s: (s.priority, -snap.cluster(s.name).prefill_token_rate))
    active = int(snap.cluster(s.name).running / max(settings.replicas, 1))
    limit = settings.knobs(s.name).max_running
    if limit is not None:  # requests over a lowered cap sit out: halve what actually runs
        active = min(active, limit)
    if active < 2:
        return None
    return s.name, active // 2


def restore_target(
    settings: Settings, specs: Sequence[ClusterSpec], only: str | None = None
) -> tuple[str, str, int] | None:
    """The highest-priority shed cluster (or `only`) and its knob back toward the spec: ("max_running" |
    "max_waiting", name, value); running first, as it is what limits service. A queue bound comes back one
    step (x2) at a time; a running cap straight to the spec (the caller may stop short of it)."""
    shed = []
    for s in specs:
        if only is not None and s.name != only:
            continue
        for rank, knob, default in (
            (0, "max_running", DEFAULT_MAX_RUNNING),
            (1, "max_waiting", DEFAULT_MAX_WAITING),
        ):
            now = getattr(settings.knobs(s.name), knob)
            spec = getattr(s.knobs, knob)
            want = spec if spec is not None else default
            if now is not None and now < want:
                value = want if knob == "max_running" else min(want, max(now * 2, 1))
                shed.append((-s.priority, rank, s.name, knob, value))
    if not shed:
        return None
    _, _, name, knob, value = min(shed)
    return knob, name, value


def reopen_target(
    snap: Snapshot, settings: Settings, specs: Sequence[ClusterSpec], pressure: tuple[float, str, str] | None
) -> tuple[str, int] | None:
    """The cluster under pressure and its maxWaiting one step back toward the spec, when it was shed and
    still rejects arrivals; None otherwise."""
    if pressure is None or snap.cluster(pressure[1]).rejection_rate <= 0:
        return None
    back = restore_target(settings, specs, only=pressure[1])
    if back is None or back[0] != "max_waiting":
        return None
    return back[1], back[2]


def is_shed(settings: Settings, spec: ClusterSpec) -> bool:
    """Whether the controller lowered this cluster's queue bound below the spec's (its 429s are then the
    intended effect, not pressure)."""
    return (settings.knobs(spec.name).max_waiting or DEFAULT_MAX_WAITING) < (
        spec.knobs.max_waiting or DEFAULT_MAX_WAITING
    )
