"""The escalation ladder: what the controller does about what the budget cannot fix.

Two rules end here (`escalate_tbt_at_the_floor`, `escalate_under_pressure`), each with its own reason.
In order: wait out the last scale or shed; scale out while below replicas.max; hold when shedding is not
called for; cap the lowest-priority cluster's running set when decodes are what is slow; else shed its
queue bound.
"""

from __future__ import annotations

from dataclasses import replace

from stallfree.operator.controller.cooldowns import CAP, SCALE, cooling, wait_out
from stallfree.operator.controller.reading import Reading
from stallfree.operator.controller.sizing import drain_bound, running_cap_within_target
from stallfree.operator.controller.targets import shed_target, throttle_target
from stallfree.operator.controller.types import SCALE_OUT, SHED, Settings, State
from stallfree.operator.controller.verdict import Verdict, hold


def escalate(
    r: Reading, s: Settings, st: State, why: str, decode_bound: bool = False, may_shed: bool = True
) -> Verdict:
    """What the budget cannot fix: wait out the last scale/shed, else scale out (below replicas.max), else
    (when allowed to shed) cap the lowest-priority cluster's running set if decodes are what is slow,
    else halve (or, with a trusted model, size) its queue bound."""
    cfg = r.cfg
    if cooling(SCALE, st, cfg):
        return wait_out(SCALE, s, why)
    if s.replicas < cfg.replicas_max:
        n = s.replicas + 1
        return Verdict(replace(s, replicas=n), SCALE_OUT, f"{why}: replicas {s.replicas} -> {n}")
    if not may_shed:
        return hold(s, f"{why}; at replicas.max, and SLOs are still met: not shedding yet")
    throttle = throttle_target(r.snap, s, r.specs) if decode_bound else None
    if throttle is not None:
        return cap_running_set(r, s, st, why, throttle)
    return shed_queue(r, s, why)


def cap_running_set(r: Reading, s: Settings, st: State, why: str, throttle: tuple[str, int]) -> Verdict:
    """Cap the throttled cluster's running set (maxRunning per replica): half of what runs, or with a
    trusted model the largest that meets the TBT target. A lowered cap pauses prompts at the next
    iteration and running streams drain within a few, so it is judged after `cap_cooldown`, not the scale
    cooldown a new replica needs (the first interval after a change still holds stalls from before it)."""
    if cooling(CAP, st, r.cfg):
        return wait_out(CAP, s, why)
    name, half = throttle
    mr = running_cap_within_target(r, s, name, half, r.budget)
    return Verdict(
        s.with_knobs(name, max_running=mr),
        SHED,
        f"{why}; at replicas.max ({r.cfg.replicas_max}): shed lowest-priority cluster {name}, "
        f"maxRunning -> {mr} per replica",
        who=name,
        scale=False,
    )


def shed_queue(r: Reading, s: Settings, why: str) -> Verdict:
    """Halve the lowest-priority queue bound (maxWaiting) with traffic; with a trusted model straight to
    the queue its share of capacity drains in time, not by halving over several scale cooldowns."""
    target = shed_target(r.snap, s, r.specs, r.cfg)
    if target is None:
        return hold(s, f"{why}; at replicas.max and nothing left to shed")
    name, mw = target
    bound = drain_bound(r, s, name)
    if bound is not None:
        mw = max(r.cfg.min_max_waiting, min(mw, bound))
    return Verdict(
        s.with_knobs(name, max_waiting=mw),
        SHED,
        f"{why}; at replicas.max ({r.cfg.replicas_max}): shed lowest-priority cluster {name}, maxWaiting -> {mw}",
        who=name,
        admission_only=True,
    )
