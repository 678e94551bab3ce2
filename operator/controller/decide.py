"""The decision core: one metrics snapshot in, the next settings and a reason out. Pure, no I/O.

Each interval, `read` turns the snapshot into a `Reading` (TBT and pressure ratios against the SLOs, the
budgets the calibrated cost model allows, prefill demand against modelled capacity), the state counts one
interval forward, and the rules below are tried in order. The first that returns a verdict decides: one
fleet-wide action at most per interval, so every change can be judged on its own. A rule is reached only
when every rule above it passed; its precondition here is what it checks besides. (rules.py holds the
rules and why each does what it does, escalation.py the ladder two of them share, sizing.py the shared
cost-model arithmetic, targets.py whom an admission change acts on, reading.py the signals.)

 1. cut_on_tbt_violation: some P99 TBT is over `violate` x its SLO (observed or, for a cluster with
    requests but no sample yet, the worst TBT the others see) and the budget is above its floor -> lower it
    to the calibrated limit (the cost model scaled by what was observed puts TBT at `target` x the
    strictest SLO; at least a tile down). Landing on the floor decode-bound (the model says the floor
    misses too) at replicas.max, the lowest-priority running set is capped in the same step. Holds within
    the shrink cooldown, except right after a raise or for a TBT SLO stricter than the last cut aimed at.
 2. escalate_tbt_at_the_floor: the same violation with the budget on its floor -> the escalation ladder,
    with decodes counted as what is slow.
 3. feedforward_cut: a cost model trusted in absolute terms puts a full iteration (the last chunk of the
    longest prompts present) over `guard` x the strictest TBT SLO among clusters with traffic, and the
    budget is above its floor -> lower it to where that iteration meets `target`, with no cooldown.
 Rules 4-9 need pressure: P99 TTFT or P50 scheduling delay over `violate` x its SLO, a queue growing by a
 request an interval or more, rejections at the spec's queue bound, or prefill arrivals beyond `overload`
 x the modelled capacity. "TBT slack" for a raise is every TBT ratio under `slack` in this and the last
 `raise_memory` intervals (clusters with TBT samples now), and it also calibrates how far a raise goes.
 4. restore_running_cap_under_pressure: TBT slack, and the cluster under pressure has a running cap the
    calibrated model lets it double -> restore it as far as the model allows (hold in the grow cooldown).
 5. reopen_a_shed_queue: TBT slack, a raise is due but the grow cooldown holds it, past the scale
    cooldown, the cluster under pressure was shed and still rejects, and (trusted model) the queue drains
    at the raised budget within `target` x its TTFT SLO -> its maxWaiting x2.
 6. raise_on_slack: TBT slack and a larger budget within the calibrated limit -> raise by `max_grow`, or
    under modelled overload to the budget that serves the arrivals (hold in the grow cooldown).
 7. hold_for_a_recent_tbt_peak: TBT slack now but not over the raise memory, no overload, the budget
    below its max -> hold.
 8. escalate_under_pressure: overload, pressure without TBT slack now, or the budget at its max -> the
    escalation ladder; shedding only for a missed SLO or rejections, or for overload once TTFT or
    scheduling delay has no slack left.
 9. hold_under_pressure: any pressure left (the calibrated limit allows no larger budget) -> hold.
 Rules 10-12 need lasting slack: `scale_in_after` intervals in a row with every ratio under `slack` and
 no queue growing, and the scale cooldown passed.
10. give_back_shed_load: a cluster shed -> restore it, the highest priority first, a running cap in one
    step before a queue bound x2.
11. probe_toward_home: the budget below the spec's (`budget_home`) and TBT slack -> raise it by half the
    pressure step, toward the spec's, within the calibrated limit.
12. scale_in: above replicas.min and prefill demand under half of what one replica fewer serves -> scale in.
13. fit_chunk_caps: a chunk cap other than min(spec chunkCap, budget) -> set it.
14. hold_steady: always -> hold ("no traffic" or "SLOs met").

The escalation ladder (rules 2 and 8), in order: within the scale cooldown, hold; below replicas.max,
scale out; when shedding is not called for, hold; decode-bound (rule 2) with the lowest-priority cluster
with traffic running 2 or more per replica, cap its running set (half, or the largest a trusted model
fits the TBT target; hold within `cap_cooldown`); else shed its queue bound (halve it, or with a trusted
model set it to the queue its share of capacity drains within `target` x its TTFT SLO; hold when nothing
is left to shed).

Hysteresis: ratios observed/SLO between `slack` and `violate` hold, and a new budget aims at `target`
(inside that band), so a steady signal never flips direction. Cooldowns count intervals since the last
change; a queue bound restarts the scale cooldown but not the budget's. Chunk caps follow the budget:
min(spec chunkCap, budget), fitted after every verdict.

This is the tokens mode's policy (spec.budget.mode tokens). In time mode the engines size each iteration
to a time target themselves, and `decide` hands over to decide_time, whose rules tune the target instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from stallfree.costmodel.model import BUILTIN, CostModel
from stallfree.operator.controller.decide_time import decide_time
from stallfree.operator.controller.outcome import Rule, conclude, first_verdict, next_interval
from stallfree.operator.controller.reading import read
from stallfree.operator.controller.rules import (
    cut_on_tbt_violation,
    escalate_tbt_at_the_floor,
    escalate_under_pressure,
    feedforward_cut,
    fit_chunk_caps,
    give_back_shed_load,
    hold_for_a_recent_tbt_peak,
    hold_steady,
    hold_under_pressure,
    probe_toward_home,
    raise_on_slack,
    reopen_a_shed_queue,
    restore_running_cap_under_pressure,
    scale_in,
)
from stallfree.operator.controller.sizing import with_caps
from stallfree.operator.controller.targets import DEFAULT_MAX_RUNNING, DEFAULT_MAX_WAITING
from stallfree.operator.controller.types import (
    ClusterSpec,
    ControllerConfig,
    Decision,
    Settings,
    Snapshot,
    State,
)

__all__ = [
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_MAX_WAITING",
    "RULES",
    "conclude",
    "decide",
    "decide_time",
    "initial_settings",
    "next_interval",
    "with_caps",
]

# The policy, in order (the module docstring says each rule's precondition).
RULES: tuple[Rule, ...] = (
    cut_on_tbt_violation,
    escalate_tbt_at_the_floor,
    feedforward_cut,
    restore_running_cap_under_pressure,
    reopen_a_shed_queue,
    raise_on_slack,
    hold_for_a_recent_tbt_peak,
    escalate_under_pressure,
    hold_under_pressure,
    give_back_shed_load,
    probe_toward_home,
    scale_in,
    fit_chunk_caps,
    hold_steady,
)


def decide(
    snap: Snapshot,
    settings: Settings,
    state: State,
    specs: Sequence[ClusterSpec],
    cfg: ControllerConfig,
    model: CostModel = BUILTIN,
) -> Decision:
    """The next settings for the fleet. `settings` are those in force; `state` comes from the last call.
    In time mode (cfg.time_target set) the time-mode policy decides (decide_time.TIME_RULES)."""
    if cfg.time_target is not None:
        return decide_time(snap, settings, state, specs, cfg, model)
    return first_verdict(RULES, read(snap, settings, specs, cfg, model, state.recent_tbt), settings, state)


def initial_settings(
    specs: Sequence[ClusterSpec], cfg: ControllerConfig, token_budget: int, replicas: int
) -> Settings:
    """Settings before any decision: the spec's knobs, chunk caps within the budget, budget and replicas
    inside their bounds, and in time mode the spec's time target (`token_budget` is then the cap)."""
    b = cfg.clamp_budget(token_budget)
    n = max(cfg.replicas_min, min(cfg.replicas_max, replicas))
    clusters = {s.name: s.knobs for s in specs}
    base = Settings(token_budget=b, replicas=n, clusters=clusters, time_target=cfg.time_target)
    return with_caps(base, specs, b)
