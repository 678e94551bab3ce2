"""The rules of the decision core, in the order `decide.RULES` tries them (its docstring is the policy).

Each rule is a pure function of the interval's reading, the settings in force and the controller's state
(already counted forward to this interval) that returns a `Verdict` (the new settings, the action and its
reason) or None to pass. A rule is only reached when every rule before it passed, and may rely on that.
Holds are verdicts too: "cooling down" is a decision, and the rules after it must not run.
"""

from __future__ import annotations

from dataclasses import replace

from stallfree.operator.controller.cooldowns import GROW, SCALE, SHRINK, cooling, wait_out
from stallfree.operator.controller.escalation import escalate
from stallfree.operator.controller.reading import Reading
from stallfree.operator.controller.sizing import (
    admitted_running_cap,
    drain_bound,
    fits_one_replica_fewer,
    probe_budget,
    raise_budget,
    running_cap_within_target,
    with_caps,
)
from stallfree.operator.controller.targets import reopen_target, restore_target, throttle_target
from stallfree.operator.controller.types import CAP, LOWER, RAISE, RESTORE, SCALE_IN, Settings, State
from stallfree.operator.controller.verdict import Verdict, hold


def tbt_why(r: Reading, violation: tuple[float, str]) -> str:
    ratio, who = violation
    if who in r.tbt_predicted:
        return f"P99 TBT of {who} predicted at {ratio:.2f}x its SLO (no sample yet; others see that TBT)"
    return f"P99 TBT of {who} at {ratio:.2f}x its SLO"


def pressure_why(r: Reading, settings: Settings) -> str:
    if r.pressure is None:
        return (
            f"prefill arrivals {r.demand:.0f} tok/s beyond {r.capacity * settings.replicas:.0f} tok/s served"
        )
    ratio, who, what = r.pressure
    return f"{what} of {who} at {ratio:.2f}x its SLO" if what.startswith("P") else f"{what} in {who}"


# ---- the rules, in the order decide.RULES tries them ---------------------------------------------------
def cut_on_tbt_violation(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Lower the budget to the calibrated TBT limit, at least a tile; decode-bound at the floor with no
    replica left to add, cap the lowest-priority running set in the same step (waiting an interval to find
    out costs an interval of stalls). The shrink cooldown keeps one bad window from cutting twice: after a
    cut (or a cap) its samples still hold the stalls from before it. After a raise they were taken at a
    smaller budget and can only understate this violation, so it is met at once. So is a violation of a
    TBT SLO stricter than any the last cut aimed at: that cut leaves it over target even once its window
    has cleared."""
    worst, cfg, b = r.tbt_violation, r.cfg, s.token_budget
    if worst is None or b <= cfg.budget_min:
        return None
    why = tbt_why(r, worst)
    stricter = st.last_direction == -1 and st.cut_slo is not None and r.tbt_slo(worst[1]) < st.cut_slo
    if cooling(SHRINK, st, cfg) and st.last_direction != 1 and not stricter:
        return wait_out(SHRINK, s, why)
    nb = cfg.clamp_budget(min(r.budget_limit, b - cfg.align))
    lowered = replace(s, token_budget=nb)
    aim = min(r.tbt_slo(name) for name, _ in r.tbt_now)  # the calibrated limit holds all of them
    throttle = _decode_bound_throttle(r, s, nb)
    if throttle is not None:
        name, mr = throttle
        return Verdict(
            lowered.with_knobs(name, max_running=mr),
            LOWER,
            f"{why}: budget {b} -> {nb}, and as decodes alone miss the target at the floor, "
            f"lowest-priority cluster {name} maxRunning -> {mr} per replica",
            direction=-1,
            cut_slo=aim,
        )
    return Verdict(lowered, LOWER, f"{why}: budget {b} -> {nb}", direction=-1, cut_slo=aim)


def _decode_bound_throttle(r: Reading, s: Settings, nb: int) -> tuple[str, int] | None:
    """(cluster, running cap) when the new budget `nb` is the floor, the calibrated model says even the
    floor misses the target with what runs now, and replicas are at their max; None otherwise."""
    floor_time = r.model.iteration_time(max(nb - r.n_decode, 0.0), r.n_decode, r.context)
    if nb != r.cfg.budget_min or floor_time <= r.time_limit or s.replicas < r.cfg.replicas_max:
        return None
    throttle = throttle_target(r.snap, s, r.specs)
    if throttle is None:
        return None
    name, half = throttle
    return name, running_cap_within_target(r, s, name, half, nb)


def escalate_tbt_at_the_floor(r: Reading, s: Settings, st: State) -> Verdict | None:
    """TBT the budget can no longer fix: the escalation ladder, decodes counted as what is slow."""
    worst = r.tbt_violation
    if worst is None or s.token_budget > r.cfg.budget_min:
        return None
    why = f"{tbt_why(r, worst)} with the budget at its floor {r.cfg.budget_min}"
    return escalate(r, s, st, why, decode_bound=True)


def feedforward_cut(r: Reading, s: Settings, st: State) -> Verdict | None:
    """No stall seen yet, but by the profile a full iteration at this budget would stall the strictest
    cluster with traffic: cut now, to where it meets `target`. Not cooled down: it reads no window."""
    cfg, b = r.cfg, s.token_budget
    if r.modelled is None or r.modelled[0] <= cfg.guard or b <= cfg.budget_min:
        return None
    nb = cfg.clamp_budget(min(r.budget_limit, b - cfg.align))
    ratio, who = r.modelled
    return Verdict(
        replace(s, token_budget=nb),
        LOWER,
        f"a full iteration at budget {b} is modelled at {ratio:.2f}x the P99 TBT SLO of {who} "
        f"(the strictest with traffic): budget {b} -> {nb}",
        direction=-1,
        cut_slo=r.tbt_slo(who),
    )


def restore_running_cap_under_pressure(r: Reading, s: Settings, st: State) -> Verdict | None:
    """A cluster capped for TBT gets its running requests back first when it is the one under pressure,
    as far as the calibrated model keeps TBT at target (doubling toward the spec)."""
    if r.pressure is None or not r.raise_slack:
        return None
    back = restore_target(s, r.specs, only=r.pressure[1])
    if back is None or back[0] != "max_running":
        return None
    _, name, want = back
    mr = admitted_running_cap(r, s, name, want)
    if mr is None:
        return None
    why = pressure_why(r, s)
    if cooling(GROW, st, r.cfg):
        return wait_out(GROW, s, why)
    return Verdict(
        s.with_knobs(name, max_running=mr),
        RESTORE,
        f"{why}, TBT has slack: {name} maxRunning -> {mr}",
        who=name,
    )


def reopen_a_shed_queue(r: Reading, s: Settings, st: State) -> Verdict | None:
    """While a raise is cooling down, the queue bound of the cluster under pressure, shed for want of a
    larger budget, comes back a step (x2): its arrivals would go on failing for a reason that has gone.
    With a trusted model, only as far as the larger budget's capacity drains in time (on hardware where
    capacity hardly grows with the budget, not at all). Not within the scale cooldown."""
    cfg, b = r.cfg, s.token_budget
    if not r.pressed or not r.raise_slack or b >= cfg.budget_max:
        return None
    nb = raise_budget(r, s)
    if nb <= b or not cooling(GROW, st, cfg) or cooling(SCALE, st, cfg):
        return None
    queue = reopen_target(r.snap, s, r.specs, r.pressure)
    if queue is None:
        return None
    name, mw = queue
    bound = drain_bound(r, s, name, nb)
    if bound is not None and mw > max(bound, cfg.min_max_waiting):
        return None
    return Verdict(
        s.with_knobs(name, max_waiting=mw),
        RESTORE,
        f"{pressure_why(r, s)}, TBT has slack and the budget is growing: {name} maxWaiting -> {mw}",
        who=name,
        admission_only=True,
    )


def raise_on_slack(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Pressure with TBT slack (this and the last `raise_memory` intervals): raise the budget by
    `max_grow`, or under modelled overload to what serves the arrivals, never past the calibrated limit;
    hold while the last change cools down."""
    cfg, b = r.cfg, s.token_budget
    if not r.pressed or not r.raise_slack or b >= cfg.budget_max:
        return None
    nb = raise_budget(r, s)
    if nb <= b:
        return None
    why = pressure_why(r, s)
    if cooling(GROW, st, cfg):
        return wait_out(GROW, s, why)
    return Verdict(
        replace(s, token_budget=nb), RAISE, f"{why}, TBT has slack: budget {b} -> {nb}", direction=1
    )


def hold_for_a_recent_tbt_peak(r: Reading, s: Settings, st: State) -> Verdict | None:
    """TBT has slack now but not over the last `raise_memory` intervals: a windowed P99 read in a lull
    between bursts of long prompts is not slack, and a raise judged on it overshoots into a violation."""
    if (
        not r.pressed
        or not r.tbt_slack
        or r.raise_slack
        or r.overloaded
        or s.token_budget >= r.cfg.budget_max
    ):
        return None
    return hold(
        s,
        f"{pressure_why(r, s)}; TBT had no slack within the last {r.cfg.raise_memory} intervals, so no raise yet",
    )


def escalate_under_pressure(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Overload, pressure without TBT slack, or the budget at its max: the escalation ladder. A queue that
    grows while every SLO is met may be a burst the budget absorbs (Poisson arrivals of long prompts queue
    up and drain, and a windowed arrival rate near capacity is as often noise as overload): a replica
    costs nothing served, but shedding fails requests for sure. So it sheds for a missed SLO or
    rejections, or for overload once queueing has eaten the TTFT / scheduling-delay slack."""
    if not r.pressed:
        return None
    if not (
        r.overloaded or (r.pressure is not None and not r.tbt_slack) or s.token_budget >= r.cfg.budget_max
    ):
        return None
    why = pressure_why(r, s)
    why = why if r.overloaded else f"{why}, no TBT slack to raise the budget"
    return escalate(r, s, st, why, may_shed=not r.queue_only or (r.overloaded and not r.latency_slack))


def hold_under_pressure(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Pressure that no rule above acts on (the calibrated limit allows no larger budget): hold."""
    if not r.pressed:
        return None
    return hold(s, f"{pressure_why(r, s)}; the calibrated cost model allows no larger budget")


def _lasting_slack(r: Reading, st: State) -> bool:
    return st.slack_streak >= r.cfg.scale_in_after and not cooling(SCALE, st, r.cfg)


def give_back_shed_load(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Lasting slack: undo shedding, the highest-priority cluster first, its running cap (in one step)
    before its queue bound (x2 a step)."""
    if not _lasting_slack(r, st):
        return None
    restore = restore_target(s, r.specs)
    if restore is None:
        return None
    knob, name, value = restore
    label = "maxRunning" if knob == "max_running" else "maxWaiting"
    return Verdict(
        s.with_knobs(name, **{knob: value}),
        RESTORE,
        f"lasting slack: {name} {label} -> {value}",
        who=name,
        admission_only=knob == "max_waiting",
    )


def probe_toward_home(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Lasting slack with TBT slack over the raise memory: step a lowered budget back toward the spec's
    (`budget_home`) by half the pressure step, like additive increase after a multiplicative decrease."""
    home, b = r.cfg.budget_home, s.token_budget
    if not _lasting_slack(r, st) or home is None or b >= home or not r.raise_slack:
        return None
    nb = probe_budget(r, s, home)
    if nb <= b:
        return None
    return Verdict(
        replace(s, token_budget=nb),
        RAISE,
        f"lasting slack: budget {b} -> {nb} (toward spec {home})",
        direction=1,
    )


def scale_in(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Lasting slack and the load fits in one replica fewer: scale in."""
    if not _lasting_slack(r, st) or not fits_one_replica_fewer(r, s):
        return None
    fewer = s.replicas - 1
    return Verdict(replace(s, replicas=fewer), SCALE_IN, f"lasting slack: replicas {s.replicas} -> {fewer}")


def fit_chunk_caps(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Chunk caps above the budget (or off the spec's) are brought to min(spec chunkCap, budget)."""
    if with_caps(s, r.specs, s.token_budget) == s:
        return None
    return Verdict(s, CAP, f"chunk caps kept within the budget {s.token_budget}")


def hold_steady(r: Reading, s: Settings, st: State) -> Verdict:
    """Nothing to do: say whether there is traffic."""
    if r.tbt_worst is None and r.pressure is None and not r.demand:
        return hold(s, "no traffic")
    return hold(s, "SLOs met")
