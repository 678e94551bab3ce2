"""The decision core in time mode: one metrics snapshot in, the next settings and a reason out. Pure, no I/O.

In time mode (spec.budget.mode time) the engines budget every iteration in seconds: its prefill is what
their cost model, refitted from their own iteration times, fits in target x the strictest P99 TBT SLO among
the clusters decoding in it, up to the token cap (spec.budget.max). The controller works on the longer
timescale: the time target (`Settings.time_target`, inside [time_target_floor, the spec's]), admission,
replicas, and the health of the engines' calibration (`Snapshot.cost_model_error`, the worst engine's P95
of |predicted/observed - 1|; above `calibration_limit` the target is never raised). The token cap stays.

`read_time` reads the interval as the tokens mode does (reading.read), modelling the iteration the target
allows now (reading.time_budget) instead of a token budget; then the rules below are tried in order and
the first verdict decides (outcome.conclude: chunk caps, cooldowns, slack streak as in tokens mode). A
rule is reached only when every rule above it passed. Ratios, hysteresis (`slack`, `violate`), the raise
memory, the cooldowns and the escalation ladder are the tokens mode's (decide.py's docstring).

 1. lower_target_on_tbt_violation: some P99 TBT is over `violate` x its SLO and the target is above its
    floor -> lower it to target x `target` / the worst ratio, at least `time_target_step` down. Holds in
    the shrink cooldown, except right after a raise or for a TBT SLO stricter than the last cut aimed at.
 2. escalate_tbt_at_the_target_floor: the same violation with the target at its floor -> the escalation
    ladder, decodes counted as what is slow.
 Rules 3-6 need pressure (P99 TTFT or P50 scheduling delay over `violate` x its SLO, a growing queue,
 rejections at the spec's bound, or prefill arrivals beyond `overload` x the modelled capacity).
 3. restore_running_cap_under_pressure: TBT slack over the raise memory, and the cluster under pressure
    has a running cap the calibrated model lets it double -> restore it (hold in the grow cooldown).
 4. raise_target_on_slack: TBT slack over the raise memory, the target below the spec's, the cost model
    calibrated -> raise by up to `max_grow`, never past the spec's nor where the worst recent TBT would
    land above `target` x its SLO (hold in the grow cooldown).
 5. hold_target_for_a_recent_tbt_peak: TBT slack now but not over the raise memory, no overload, the
    target below the spec's -> hold.
 6. escalate_target_under_pressure: overload, pressure without TBT slack, the target at the spec's, or a
    miscalibrated cost model -> the escalation ladder.
 Rules 7-9 need lasting slack: `scale_in_after` intervals in a row with every ratio under `slack` and no
 queue growing, and the scale cooldown passed.
 7. give_back_shed_load: a cluster shed -> restore it, the highest priority first.
 8. probe_target_toward_home: the target below the spec's, TBT slack over the raise memory, the cost model
    calibrated -> raise it by up to half `max_grow`, toward the spec's.
 9. scale_in: above replicas.min and prefill demand under half of what one replica fewer serves.
10. fit_chunk_caps: a chunk cap other than min(spec chunkCap, cap) -> set it.
11. hold_target_steady: always -> hold ("no traffic" or "SLOs met", and why a lowered target stays down
    while the cost model is miscalibrated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from stallfree.costmodel.model import BUILTIN, CostModel
from stallfree.operator.controller.outcome import Rule, first_verdict
from stallfree.operator.controller.reading import Reading, read, time_budget
from stallfree.operator.controller.rules import (
    fit_chunk_caps,
    give_back_shed_load,
    restore_running_cap_under_pressure,
    scale_in,
)
from stallfree.operator.controller.time_rules import (
    escalate_target_under_pressure,
    escalate_tbt_at_the_target_floor,
    hold_target_for_a_recent_tbt_peak,
    hold_target_steady,
    lower_target_on_tbt_violation,
    probe_target_toward_home,
    raise_target_on_slack,
)
from stallfree.operator.controller.types import (
    ClusterSpec,
    ControllerConfig,
    Decision,
    Settings,
    Snapshot,
    State,
)

__all__ = ["TIME_RULES", "decide_time", "read_time"]

# The time mode's policy, in order (the module docstring says each rule's precondition).
TIME_RULES: tuple[Rule, ...] = (
    lower_target_on_tbt_violation,
    escalate_tbt_at_the_target_floor,
    restore_running_cap_under_pressure,
    raise_target_on_slack,
    hold_target_for_a_recent_tbt_peak,
    escalate_target_under_pressure,
    give_back_shed_load,
    probe_target_toward_home,
    scale_in,
    fit_chunk_caps,
    hold_target_steady,
)


def read_time(
    snap: Snapshot,
    settings: Settings,
    specs: Sequence[ClusterSpec],
    cfg: ControllerConfig,
    model: CostModel,
    recent: Sequence[tuple[tuple[str, float], ...]] = (),
) -> Reading:
    """The interval's reading in time mode: the iteration modelled is the one the time target allows."""
    return read(snap, settings, specs, cfg, model, recent, budget=time_budget(snap, settings, specs, model))


def decide_time(
    snap: Snapshot,
    settings: Settings,
    state: State,
    specs: Sequence[ClusterSpec],
    cfg: ControllerConfig,
    model: CostModel = BUILTIN,
) -> Decision:
    """The next settings for a time-mode fleet (cfg.time_target set; `settings.time_target` in force, the
    spec's when None). Same arguments and result as decide.decide."""
    if cfg.time_target is None:
        raise ValueError("decide_time needs a time-mode ControllerConfig (time_target set)")
    if settings.time_target is None:
        settings = replace(settings, time_target=cfg.time_target)
    return first_verdict(
        TIME_RULES, read_time(snap, settings, specs, cfg, model, state.recent_tbt), settings, state
    )
