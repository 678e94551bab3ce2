"""The time mode's own rules, in the order `decide_time.TIME_RULES` tries them (its docstring is the policy).

In time mode the engines size every iteration themselves: its prefill is what their calibrated cost model
fits in target x the strictest P99 TBT SLO among the clusters decoding in it. What is left for the
controller is the longer timescale: the target itself (its margin, 1 - target, absorbs the prediction error
and the server's overhead per token, and the observed P99 TBT says whether it is enough), admission and
replicas (the ladder the tokens mode uses, escalation.py), and whether the engines' cost model can be
trusted at all. Same contract as rules.py: pure functions of the reading, the settings in force and the
state, returning a verdict or None to pass.
"""

from __future__ import annotations

from dataclasses import replace

from stallfree.operator.controller.cooldowns import GROW, SCALE, SHRINK, cooling, wait_out
from stallfree.operator.controller.escalation import escalate
from stallfree.operator.controller.reading import Reading
from stallfree.operator.controller.rules import pressure_why, tbt_why
from stallfree.operator.controller.types import LOWER, RAISE, Settings, State
from stallfree.operator.controller.verdict import Verdict, hold


def home(r: Reading) -> float:
    """The spec's time target: where raises stop."""
    return r.cfg.time_target or 1.0


def target_of(r: Reading, s: Settings) -> float:
    """The time target in force (the spec's when the settings carry none)."""
    return s.time_target if s.time_target is not None else home(r)


def calibration_why(r: Reading) -> str:
    """What the engines' cost-model error says, for a reason."""
    err = r.snap.cost_model_error
    return (
        f"the engines' cost model misses iteration times by {err:.2f} (P95 |predicted/observed - 1|, "
        f"limit {r.cfg.calibration_limit:g})"
    )


def _raised(r: Reading, t: float, grow: float) -> float:
    """A target raised by up to `grow` (relative, at least one step), never past the spec's nor past where
    the worst TBT peak of the raise memory would land at `target` x its SLO (if TBT scales with it)."""
    cfg = r.cfg
    want = max(t * (1 + grow), t + cfg.time_target_step)
    if r.tbt_peak is not None and r.tbt_peak > 0:
        want = min(want, t * cfg.target / r.tbt_peak)
    return cfg.clamp_time_target(want)


# ---- the rules, in the order decide_time.TIME_RULES tries them -----------------------------------------
def lower_target_on_tbt_violation(r: Reading, s: Settings, st: State) -> Verdict | None:
    """A P99 TBT over its SLO with the target above its floor: the margin the target leaves does not cover
    what the engines' predictions miss plus the server's overhead. Lower the target to where the worst TBT
    lands at `target` x its SLO if TBT scales with it, at least a step. The shrink cooldown and its two
    exceptions are the tokens mode's (rules.cut_on_tbt_violation): one bad window must not cut twice, but
    right after a raise, or for a stricter SLO than the last cut aimed at, the violation is met at once."""
    worst, cfg = r.tbt_violation, r.cfg
    t = target_of(r, s)
    if worst is None or t <= cfg.time_target_floor:
        return None
    why = tbt_why(r, worst)
    if r.miscalibrated:
        why = f"{why}; {calibration_why(r)}"
    stricter = st.last_direction == -1 and st.cut_slo is not None and r.tbt_slo(worst[1]) < st.cut_slo
    if cooling(SHRINK, st, cfg) and st.last_direction != 1 and not stricter:
        return wait_out(SHRINK, s, why)
    nt = cfg.clamp_time_target(min(t * cfg.target / worst[0], t - cfg.time_target_step))
    aim = min(r.tbt_slo(name) for name, _ in r.tbt_now)
    return Verdict(
        replace(s, time_target=nt),
        LOWER,
        f"{why}: time target {t:.2f} -> {nt:.2f}",
        direction=-1,
        cut_slo=aim,
    )


def escalate_tbt_at_the_target_floor(r: Reading, s: Settings, st: State) -> Verdict | None:
    """TBT the target can no longer fix (decodes alone, or an overhead larger than the margin): the
    escalation ladder, decodes counted as what is slow."""
    worst = r.tbt_violation
    if worst is None or target_of(r, s) > r.cfg.time_target_floor:
        return None
    why = f"{tbt_why(r, worst)} with the time target at its floor {r.cfg.time_target_floor:.2f}"
    return escalate(r, s, st, why, decode_bound=True)


def raise_target_on_slack(r: Reading, s: Settings, st: State) -> Verdict | None:
    """TTFT, scheduling-delay or queue pressure with TBT slack over the raise memory, a target below the
    spec's and a calibrated cost model: give prefill longer iterations. Up by `max_grow`, never past the
    spec's nor past where the worst recent TBT lands at `target`; hold while the last change cools down."""
    t, cfg = target_of(r, s), r.cfg
    if not r.pressed or not r.raise_slack or t >= home(r) or r.miscalibrated:
        return None
    nt = _raised(r, t, cfg.max_grow)
    if nt <= t:
        return None
    why = pressure_why(r, s)
    if cooling(GROW, st, cfg):
        return wait_out(GROW, s, why)
    return Verdict(
        replace(s, time_target=nt),
        RAISE,
        f"{why}, TBT has slack: time target {t:.2f} -> {nt:.2f}",
        direction=1,
    )


def hold_target_for_a_recent_tbt_peak(r: Reading, s: Settings, st: State) -> Verdict | None:
    """TBT has slack now but not over the raise memory: a window read in a lull between bursts of long
    prompts is not slack (as rules.hold_for_a_recent_tbt_peak)."""
    t = target_of(r, s)
    if not r.pressed or not r.tbt_slack or r.raise_slack or r.overloaded or t >= home(r):
        return None
    return hold(
        s,
        f"{pressure_why(r, s)}; TBT had no slack within the last {r.cfg.raise_memory} intervals, "
        "so the time target is not raised yet",
    )


def escalate_target_under_pressure(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Pressure the target cannot relieve: modelled overload, no TBT slack, the target already at the
    spec's, or a cost model too far off to lengthen iterations on. The escalation ladder, shedding only
    for a missed SLO or rejections, or for overload once TTFT or scheduling delay has no slack left."""
    if not r.pressed:
        return None
    t = target_of(r, s)
    if r.overloaded:
        because = ""
    elif r.pressure is not None and not r.tbt_slack:
        because = ", no TBT slack to raise the time target"
    elif t >= home(r):
        because = f", time target at the spec's {home(r):.2f}"
    elif r.miscalibrated:
        because = f"; {calibration_why(r)}: time target not raised"
    else:
        return None
    why = pressure_why(r, s) + because
    return escalate(r, s, st, why, may_shed=not r.queue_only or (r.overloaded and not r.latency_slack))


def probe_target_toward_home(r: Reading, s: Settings, st: State) -> Verdict | None:
    """Lasting slack with TBT slack over the raise memory and a calibrated cost model: step a lowered
    target back toward the spec's by half the pressure step (as rules.probe_toward_home)."""
    t, cfg = target_of(r, s), r.cfg
    lasting = st.slack_streak >= cfg.scale_in_after and not cooling(SCALE, st, cfg)
    if not lasting or t >= home(r) or not r.raise_slack or r.miscalibrated:
        return None
    nt = _raised(r, t, cfg.max_grow / 2)
    if nt <= t:
        return None
    return Verdict(
        replace(s, time_target=nt),
        RAISE,
        f"lasting slack: time target {t:.2f} -> {nt:.2f} (toward spec {home(r):.2f})",
        direction=1,
    )


def hold_target_steady(r: Reading, s: Settings, st: State) -> Verdict:
    """Nothing to do: say whether there is traffic, and when a lowered target stays down because the
    engines' cost model is off, say that too."""
    base = "no traffic" if r.tbt_worst is None and r.pressure is None and not r.demand else "SLOs met"
    t = target_of(r, s)
    if r.miscalibrated and t < home(r):
        return hold(s, f"{base}; {calibration_why(r)}: time target kept at {t:.2f}")
    return hold(s, base)
