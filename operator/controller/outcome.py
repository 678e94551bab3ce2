"""What every rule list shares: the state counted one interval forward, and a verdict turned into a decision.

`decide` (tokens mode) and `decide_time` (time mode) both count the state forward with `next_interval`,
try their rules in order, and conclude the first verdict with `conclude`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from stallfree.operator.controller.cooldowns import restart, tick
from stallfree.operator.controller.reading import Reading
from stallfree.operator.controller.sizing import with_caps
from stallfree.operator.controller.types import (
    HOLD,
    RESTORE,
    SCALE_IN,
    SCALE_OUT,
    SHED,
    Decision,
    Settings,
    State,
)
from stallfree.operator.controller.verdict import Verdict

Rule = Callable[[Reading, Settings, State], Verdict | None]


def next_interval(state: State, r: Reading) -> State:
    """The state counted one interval forward: cooldowns and the slack streak, and this interval's TBT
    ratios remembered for the next `raise_memory` raises."""
    cfg = r.cfg
    return replace(
        tick(state),
        recent_tbt=(*state.recent_tbt, r.tbt_now)[-cfg.raise_memory :] if cfg.raise_memory else (),
        slack_streak=state.slack_streak + 1 if r.all_slack else 0,
    )


def conclude(v: Verdict, r: Reading, st: State) -> Decision:
    """The decision for a verdict: chunk caps fitted to its budget, and the state it leaves. Any change
    ends the slack streak; a change other than a queue bound restarts the budget's cooldown and records
    its direction; a scale-out/in, shed or restore (one that asks to) restarts the scale cooldown."""
    new = with_caps(v.settings, r.specs, v.settings.token_budget)
    s2 = st
    if v.action != HOLD:
        s2 = replace(s2, slack_streak=0)
        if not v.admission_only:
            s2 = replace(s2, last_direction=v.direction)
        scaled = v.scale and v.action in (SCALE_OUT, SCALE_IN, SHED, RESTORE)
        s2 = restart(s2, change=not v.admission_only, scale=scaled)
    if v.cut_slo is not None:
        s2 = replace(s2, cut_slo=v.cut_slo)
    names = [v.who] if v.who else [s.name for s in r.specs]
    return Decision(
        settings=new,
        state=s2,
        action=v.action,
        reason=v.reason,
        cluster_actions={n: v.action for n in names},
        cluster_reasons={n: v.reason for n in names},
    )


def first_verdict(rules: Sequence[Rule], r: Reading, settings: Settings, state: State) -> Decision:
    """Count the interval forward and let the first rule that decides decide (the last rule always does)."""
    st = next_interval(state, r)
    for rule in rules:
        verdict = rule(r, settings, st)
        if verdict is not None:
            return conclude(verdict, r, st)
    raise AssertionError(f"unreachable: the last rule, {rules[-1].__name__}, always decides")
