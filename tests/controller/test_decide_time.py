"""The decision core in time mode (decide_time.TIME_RULES): each time-mode rule on its own, then decide()
over a few intervals. The engines size iterations to the time target themselves; the controller lowers the
target on a TBT violation, raises it back toward the spec's on TBT slack under pressure (never above it),
never raises it while the engines' cost model is miscalibrated, and keeps the replica / admission ladder.
"""

from __future__ import annotations

import re

import pytest
from controller_factories import CHAT_SLO, make_config, make_profile, make_snapshot, make_specs

from stallfree.costmodel.model import BUILTIN
from stallfree.operator.controller import State, decide
from stallfree.operator.controller import time_rules as T
from stallfree.operator.controller.decide import initial_settings
from stallfree.operator.controller.decide_time import TIME_RULES, decide_time, read_time
from stallfree.operator.controller.decide_time import __doc__ as POLICY
from stallfree.operator.controller.types import (
    HOLD,
    LOWER,
    RAISE,
    SCALE_OUT,
    SHED,
    ControllerConfig,
    Settings,
)

SPECS = make_specs()
CFG = make_config(time_target=0.8)
FRESH = State()
SLACK = State(slack_streak=6, intervals_since_scale=9)  # lasting slack (scale_in_after = 6)


def start(target=None, replicas=1, cfg=CFG) -> Settings:
    s = initial_settings(SPECS, cfg, cfg.budget_max, replicas)
    return s if target is None else Settings(s.token_budget, s.replicas, s.clusters, target)


def look(snap, s, cfg=CFG, model=BUILTIN, recent=()):
    return read_time(snap, s, SPECS, cfg, model, recent)


def calibrated(snap, error):
    """`snap` with the engines' cost-model error (P95) set."""
    return snap.__class__(snap.time, snap.clusters, snap.replicas_seen, snap.kv_cache_usage, error)


STALL = make_snapshot(chat=dict(tbt_p99=0.2, running=8))  # chat at 2x its TBT SLO
TTFT = make_snapshot(chat=dict(tbt_p99=0.03, ttft_p99=2.5, running=4, arrival_rate=2))  # TBT at 0.3x
QUIET = make_snapshot(
    chat=dict(tbt_p99=0.01, ttft_p99=0.05, running=1, arrival_rate=0.1, prefill_token_rate=10)
)


def test_the_docstring_lists_the_rules_in_the_order_decide_time_tries_them():
    listed = re.findall(r"^ ?\d+\. (\w+):", POLICY, flags=re.MULTILINE)
    assert listed == [rule.__name__ for rule in TIME_RULES]


def test_time_mode_settings_keep_the_cap_and_carry_the_target_to_the_engines():
    s = start()
    assert (s.token_budget, s.time_target) == (2048, 0.8)
    assert s.engine_patch()["timeTarget"] == 0.8 and s.engine_patch()["tokenBudget"] == 2048
    tokens = initial_settings(SPECS, make_config(), 512, 1)
    assert tokens.time_target is None and "timeTarget" not in tokens.engine_patch()  # tokens mode as before
    with pytest.raises(ValueError, match="timeTarget must be in"):
        make_config(time_target=1.5)
    assert CFG.clamp_time_target(0.05) == 0.2 and CFG.clamp_time_target(0.93) == 0.8
    assert make_config(time_target=0.1).time_target_floor == 0.1  # a spec below the floor is its own floor


def test_decide_hands_a_time_mode_config_to_decide_time():
    d = decide(STALL, start(), FRESH, SPECS, CFG)
    assert d.action == LOWER and d.settings.time_target < 0.8 and d.settings.token_budget == 2048, d.reason
    assert d == decide_time(STALL, start(), FRESH, SPECS, CFG)
    with pytest.raises(ValueError, match="time-mode"):
        decide_time(STALL, start(), FRESH, SPECS, make_config())


# ---- 1. a TBT violation lowers the target -------------------------------------------------------------------
def test_a_tbt_violation_lowers_the_target_where_tbt_would_land_at_target():
    v = T.lower_target_on_tbt_violation(look(STALL, start()), start(), FRESH)
    assert v.action == LOWER and v.direction == -1 and v.cut_slo == CHAT_SLO.tbt_p99, v.reason
    assert v.settings.time_target == 0.34  # 0.8 x 0.85 / 2.0
    assert v.settings.token_budget == 2048  # the cap stays
    assert "P99 TBT of chat at 2.00x its SLO: time target 0.80 -> 0.34" in v.reason
    slight = make_snapshot(chat=dict(tbt_p99=0.105, running=8))  # 1.05x
    assert T.lower_target_on_tbt_violation(look(slight, start()), start(), FRESH).settings.time_target == 0.65
    tiny = make_snapshot(chat=dict(tbt_p99=0.101, running=8))  # aims at 0.85x, inside the hold band
    assert T.lower_target_on_tbt_violation(look(tiny, start()), start(), FRESH).settings.time_target == 0.67


def test_lowering_stops_at_the_floor_and_passes_in_band():
    deep = make_snapshot(chat=dict(tbt_p99=2.0, running=8))
    assert T.lower_target_on_tbt_violation(look(deep, start()), start(), FRESH).settings.time_target == 0.2
    assert T.lower_target_on_tbt_violation(look(STALL, start(0.2)), start(0.2), FRESH) is None
    in_band = make_snapshot(chat=dict(tbt_p99=0.09, running=8))
    assert T.lower_target_on_tbt_violation(look(in_band, start()), start(), FRESH) is None


def test_lowering_cools_down_unless_after_a_raise_or_for_a_stricter_slo():
    cfg = make_config(time_target=0.8, shrink_cooldown=3)
    r, s = look(STALL, start(cfg=cfg), cfg), start(cfg=cfg)

    def after(**state):
        return T.lower_target_on_tbt_violation(r, s, State(intervals_since_change=1, **state)).action

    assert after(last_direction=-1, cut_slo=0.1) == HOLD  # a cut's window still holds its stalls
    assert after(last_direction=1) == LOWER  # right after a raise
    assert after(last_direction=-1, cut_slo=0.25) == LOWER  # chat's 0.1 s is stricter than the last aim


def test_a_miscalibrated_model_is_named_in_the_cut():
    v = T.lower_target_on_tbt_violation(look(calibrated(STALL, 0.8), start()), start(), FRESH)
    assert v.action == LOWER and "misses iteration times by 0.80" in v.reason


# ---- 2. at the floor: the escalation ladder -----------------------------------------------------------------
def test_tbt_at_the_target_floor_scales_out_then_caps_the_decodes():
    cfg = make_config(time_target=0.8, replicas_max=2)
    s = start(0.2, cfg=cfg)
    v = T.escalate_tbt_at_the_target_floor(look(STALL, s, cfg), s, FRESH)
    assert v.action == SCALE_OUT and v.settings.replicas == 2 and "time target at its floor 0.20" in v.reason
    assert v.settings.time_target == 0.2
    docs = make_snapshot(
        chat=dict(tbt_p99=0.2, running=2), summarization=dict(tbt_p99=0.5, running=12, arrival_rate=0.5)
    )
    v = T.escalate_tbt_at_the_target_floor(look(docs, start(0.2)), start(0.2), FRESH)
    assert v.action == SHED and v.settings.knobs("summarization").max_running == 6, v.reason
    assert T.escalate_tbt_at_the_target_floor(look(STALL, start()), start(), FRESH) is None  # above the floor


# ---- 3-6. under pressure -------------------------------------------------------------------------------------
def test_pressure_with_tbt_slack_raises_the_target_back_never_above_the_specs():
    v = T.raise_target_on_slack(look(TTFT, start(0.4)), start(0.4), FRESH)
    assert v.action == RAISE and v.direction == 1 and v.settings.time_target == 0.6, v.reason  # +50%
    assert "time target 0.40 -> 0.60" in v.reason
    v = T.raise_target_on_slack(look(TTFT, start(0.7)), start(0.7), FRESH)
    assert v.settings.time_target == 0.8  # capped at the spec's
    assert T.raise_target_on_slack(look(TTFT, start()), start(), FRESH) is None  # at the spec's already
    cooling = State(intervals_since_change=1)
    assert T.raise_target_on_slack(look(TTFT, start(0.4)), start(0.4), cooling).action == HOLD


def test_a_raise_stops_where_the_recent_tbt_peak_lands_at_target():
    tight = make_snapshot(chat=dict(tbt_p99=0.07, ttft_p99=2.5, running=4, arrival_rate=2))  # 0.7x
    v = T.raise_target_on_slack(look(tight, start(0.4), recent=((("chat", 0.75),),)), start(0.4), FRESH)
    assert v.settings.time_target == 0.45  # 0.4 x 0.85 / 0.75
    peak = ((("chat", 0.9),),)
    assert T.raise_target_on_slack(look(TTFT, start(0.4), recent=peak), start(0.4), FRESH) is None
    v = T.hold_target_for_a_recent_tbt_peak(look(TTFT, start(0.4), recent=peak), start(0.4), FRESH)
    assert v.action == HOLD and "not raised yet" in v.reason


def test_miscalibration_blocks_raises_and_says_so():
    off = calibrated(TTFT, 0.7)
    r = look(off, start(0.4))
    assert r.miscalibrated and T.raise_target_on_slack(r, start(0.4), FRESH) is None
    v = T.escalate_target_under_pressure(r, start(0.4), FRESH)  # TTFT missed at replicas.max: the ladder
    assert v.action == SHED and "misses iteration times by 0.70" in v.reason and "not raised" in v.reason
    cfg = make_config(time_target=0.8, replicas_max=2)
    s = start(0.4, cfg=cfg)
    v = T.escalate_target_under_pressure(look(off, s, cfg), s, FRESH)
    assert v.action == SCALE_OUT and v.settings.time_target == 0.4, v.reason
    # within the limit the raise happens
    assert T.raise_target_on_slack(look(calibrated(TTFT, 0.3), start(0.4)), start(0.4), FRESH).action == RAISE


def test_pressure_the_target_cannot_relieve_escalates():
    cfg = make_config(time_target=0.8, replicas_max=2)
    v = T.escalate_target_under_pressure(look(TTFT, start(cfg=cfg), cfg), start(cfg=cfg), FRESH)
    assert v.action == SCALE_OUT and "time target at the spec's 0.80" in v.reason
    late = make_snapshot(
        summarization=dict(tbt_p99=0.22, ttft_p99=12.0, running=4, waiting=12, arrival_rate=0.5)
    )
    v = T.escalate_target_under_pressure(look(late, start(0.4)), start(0.4), FRESH)
    assert v.action == SHED and v.settings.knobs("summarization").max_waiting == 16, v.reason
    assert "no TBT slack to raise the time target" in v.reason
    slack = look(TTFT, start(0.4))
    assert T.escalate_target_under_pressure(slack, start(0.4), FRESH) is None  # a raise relieves it instead


# ---- 7-11. lasting slack, hold ---------------------------------------------------------------------------------
def test_lasting_slack_probes_the_target_back_toward_the_specs():
    v = T.probe_target_toward_home(look(QUIET, start(0.4)), start(0.4), SLACK)
    assert v.action == RAISE and v.settings.time_target == 0.5, v.reason  # +25%
    assert "toward spec 0.80" in v.reason
    assert T.probe_target_toward_home(look(QUIET, start()), start(), SLACK) is None
    assert T.probe_target_toward_home(look(QUIET, start(0.4)), start(0.4), FRESH) is None
    assert T.probe_target_toward_home(look(calibrated(QUIET, 0.9), start(0.4)), start(0.4), SLACK) is None


def test_hold_steady_says_why_a_lowered_target_stays_down():
    assert T.hold_target_steady(look(make_snapshot(), start()), start(), FRESH).reason == "no traffic"
    assert T.hold_target_steady(look(QUIET, start(0.4)), start(0.4), FRESH).reason == "SLOs met"
    v = T.hold_target_steady(look(calibrated(QUIET, 0.9), start(0.4)), start(0.4), FRESH)
    assert v.reason.startswith("SLOs met; the engines' cost model misses") and "kept at 0.40" in v.reason


# ---- decide over intervals --------------------------------------------------------------------------------------
def run(snaps, s, state=FRESH, cfg=CFG):
    out = []
    for snap in snaps:
        d = decide(snap, s, state, SPECS, cfg)
        s, state = d.settings, d.state
        out.append(d)
    return out


def test_a_violation_then_pressure_with_slack_brings_the_target_back_to_the_specs_and_no_further():
    decisions = run([STALL] + [TTFT] * 12, start())
    targets = [d.settings.time_target for d in decisions]
    assert decisions[0].action == LOWER and targets[0] == 0.34
    assert all(0.2 <= t <= 0.8 for t in targets)
    assert targets[1:] == sorted(targets[1:]) and targets[-1] == 0.8  # climbed back, never down again
    raises = [d for d in decisions if d.action == RAISE]
    assert raises and all(d.settings.time_target <= 0.8 for d in raises)
    assert all(d.settings.token_budget == 2048 for d in decisions)
    assert decisions[-1].action != RAISE  # at the spec's: nothing more to raise


def test_while_miscalibrated_the_target_never_rises():
    decisions = run([STALL] + [calibrated(TTFT, 0.75)] * 10 + [calibrated(QUIET, 0.75)] * 10, start())
    assert decisions[0].action == LOWER
    assert all(d.action != RAISE for d in decisions[1:])
    assert {d.settings.time_target for d in decisions} == {0.34}


def test_the_cap_and_chunk_caps_stay_while_the_target_moves():
    d = decide(STALL, start(), FRESH, SPECS, CFG)
    assert d.settings.knobs("summarization").chunk_cap == 256 and d.settings.knobs("chat").chunk_cap == 2048


def test_with_a_profile_the_reading_models_the_iteration_the_target_allows():
    profile = make_profile()
    r = look(TTFT, start(), model=profile)
    assert 1 < r.budget < 2048  # 0.8 x 0.1 s of this CPU's iteration: well under the cap
    assert look(TTFT, start(), model=BUILTIN).budget == 2048  # a shape-only model: the cap
    assert look(make_snapshot(), start(), model=profile).budget == 2048  # nobody decodes: the cap


def test_a_time_mode_config_needs_a_target_in_range():
    with pytest.raises(ValueError):
        ControllerConfig(time_target=0.0)
