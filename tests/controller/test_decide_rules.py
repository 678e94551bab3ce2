"""Each rule of the decision core on its own: the reading that meets its precondition, and one that passes.

A rule gets the interval's reading, the settings in force and the state already counted forward to this
interval (as `decide` hands it), and returns a verdict or None.
"""

from __future__ import annotations

import re

import pytest
from controller_factories import CHAT_SLO, SUMM_SLO, make_config, make_profile, make_snapshot, make_specs

from stallfree.costmodel.model import BUILTIN, LinearCostModel
from stallfree.operator.controller import State
from stallfree.operator.controller import rules as R
from stallfree.operator.controller.decide import RULES, initial_settings
from stallfree.operator.controller.decide import __doc__ as POLICY
from stallfree.operator.controller.reading import read
from stallfree.operator.controller.types import (
    CAP,
    HOLD,
    LOWER,
    RAISE,
    RESTORE,
    SCALE_IN,
    SCALE_OUT,
    SHED,
    Slo,
)

SPECS = make_specs()
CFG = make_config()
FRESH = State()  # long past every cooldown, no memory
SLACK = State(slack_streak=6, intervals_since_scale=9)  # lasting slack (scale_in_after = 6)


def look(snap, s, cfg=CFG, model=BUILTIN, specs=SPECS, recent=()):
    return read(snap, s, specs, cfg, model, recent)


def start(budget=512, replicas=1, cfg=CFG, specs=SPECS):
    return initial_settings(specs, cfg, budget, replicas)


def test_the_docstring_lists_the_rules_in_the_order_decide_tries_them():
    listed = re.findall(r"^ ?\d+\. (\w+):", POLICY, flags=re.MULTILINE)
    assert listed == [rule.__name__ for rule in RULES]


# ---- 1. cut on a TBT violation ----------------------------------------------------------------------------
STALL = make_snapshot(chat=dict(tbt_p99=0.2, running=8))  # chat at 2x its TBT SLO


def test_cut_on_tbt_violation_lowers_to_the_calibrated_limit_and_remembers_its_aim():
    v = R.cut_on_tbt_violation(look(STALL, start()), start(), FRESH)
    assert v.action == LOWER and v.settings.token_budget < 512 and v.direction == -1, v.reason
    assert v.cut_slo == CHAT_SLO.tbt_p99 and "P99 TBT of chat at 2.00x" in v.reason


@pytest.mark.parametrize(
    "snap, budget",
    [(make_snapshot(chat=dict(tbt_p99=0.09, running=8)), 512), (STALL, 128)],
    ids=["in-band", "at-the-floor"],
)
def test_cut_on_tbt_violation_passes(snap, budget):
    assert R.cut_on_tbt_violation(look(snap, start(budget)), start(budget), FRESH) is None


def test_cut_on_tbt_violation_cools_down_unless_after_a_raise_or_for_a_stricter_slo():
    cfg = make_config(shrink_cooldown=3)
    r, s = look(STALL, start(cfg=cfg), cfg), start(cfg=cfg)
    after_cut = State(intervals_since_change=1, last_direction=-1, cut_slo=CHAT_SLO.tbt_p99)
    assert R.cut_on_tbt_violation(r, s, after_cut).action == HOLD
    assert R.cut_on_tbt_violation(r, s, State(intervals_since_change=1, last_direction=1)).action == LOWER
    stricter = State(intervals_since_change=1, last_direction=-1, cut_slo=SUMM_SLO.tbt_p99)
    assert R.cut_on_tbt_violation(r, s, stricter).action == LOWER
    capped_since = State(intervals_since_change=1, last_direction=0, cut_slo=SUMM_SLO.tbt_p99)
    assert R.cut_on_tbt_violation(r, s, capped_since).action == HOLD  # the last change was no cut


def test_cut_on_tbt_violation_caps_the_running_set_when_decode_bound_at_the_floor():
    decode_heavy = LinearCostModel(base=0.02, per_prefill=1e-4, per_decode=1e-3, per_decode_context=1e-5)
    snap = make_snapshot(
        chat=dict(tbt_p99=0.5, running=4, arrival_rate=2, mean_context=200),
        summarization=dict(
            running=20, waiting=5, arrival_rate=0.5, prefill_token_rate=800, mean_context=2000
        ),
    )
    v = R.cut_on_tbt_violation(look(snap, start(1024), model=decode_heavy), start(1024), FRESH)
    assert v.settings.token_budget == 128 and v.settings.knobs("summarization").max_running == 10, v.reason


# ---- 2. TBT at the floor: the escalation ladder -------------------------------------------------------------
def test_escalate_tbt_at_the_floor_scales_out_and_passes_above_the_floor():
    cfg = make_config(replicas_max=2)
    v = R.escalate_tbt_at_the_floor(look(STALL, start(128, cfg=cfg), cfg), start(128, cfg=cfg), FRESH)
    assert v.action == SCALE_OUT and v.settings.replicas == 2 and "at its floor 128" in v.reason
    assert R.escalate_tbt_at_the_floor(look(STALL, start(512)), start(512), FRESH) is None
    calm = make_snapshot(chat=dict(tbt_p99=0.05, running=8))
    assert R.escalate_tbt_at_the_floor(look(calm, start(128)), start(128), FRESH) is None


# ---- 3. feedforward cut -------------------------------------------------------------------------------------
CPU_SPECS = make_specs(chat_slo=Slo(ttft_p99=5.0, tbt_p99=1.0, scheduling_delay_p50=2.0),
                       summ_slo=Slo(ttft_p99=30.0, tbt_p99=5.0, scheduling_delay_p50=15.0))  # fmt: skip
CHAT_INTO_DOCS = make_snapshot(
    summarization=dict(tbt_p99=2.0, running=2, waiting=4, arrival_rate=0.5, prefill_token_rate=1000,
                       mean_context=2000),
    chat=dict(arrival_rate=1.0, prefill_token_rate=80, mean_context=80),
)  # fmt: skip


@pytest.mark.parametrize("budget, model, cuts", [(1024, make_profile(), True), (32, make_profile(), False),
                                                 (1024, BUILTIN, False)], ids=["profile", "floor", "shape-only"])  # fmt: skip
def test_feedforward_cut(budget, model, cuts):
    cfg = make_config(budget_min=32, budget_max=2048)
    s = start(budget, cfg=cfg, specs=CPU_SPECS)
    v = R.feedforward_cut(look(CHAT_INTO_DOCS, s, cfg, model, CPU_SPECS), s, FRESH)
    assert (v is not None) == cuts
    if cuts:
        assert v.action == LOWER and v.settings.token_budget < budget and v.cut_slo == 1.0, v.reason


# ---- 4-9. under pressure ------------------------------------------------------------------------------------
QUEUED = dict(running=4, waiting=30, ttft_p99=25.0, tbt_p99=0.1, arrival_rate=0.5, mean_context=600)
ROOMY = LinearCostModel(base=0.02, per_prefill=1e-5, per_decode=5e-4, per_decode_context=0.0)


def test_restore_running_cap_under_pressure():
    s = start().with_knobs("summarization", max_running=4)
    snap = make_snapshot(chat=dict(tbt_p99=0.075, running=4), summarization=QUEUED)
    r = look(snap, s, model=ROOMY)
    v = R.restore_running_cap_under_pressure(r, s, FRESH)
    assert v.action == RESTORE and v.settings.knobs("summarization").max_running == 8, v.reason
    assert R.restore_running_cap_under_pressure(r, s, State(intervals_since_change=1)).action == HOLD
    heavy = LinearCostModel(base=0.02, per_prefill=1e-5, per_decode=0.05, per_decode_context=0.0)
    assert R.restore_running_cap_under_pressure(look(snap, s, model=heavy), s, FRESH) is None
    assert R.restore_running_cap_under_pressure(look(snap, start(), model=ROOMY), start(), FRESH) is None


REJECTING = make_snapshot(
    summarization=dict(
        tbt_p99=0.05, ttft_p99=40.0, running=2, waiting=2, arrival_rate=0.5, rejection_rate=0.3
    )
)


def test_reopen_a_shed_queue_in_the_raises_cooldown():
    s = start(128).with_knobs("summarization", max_waiting=2)
    r = look(REJECTING, s)
    raised = State(intervals_since_change=1, last_direction=1)  # the interval after a raise
    v = R.reopen_a_shed_queue(r, s, raised)
    assert v.action == RESTORE and v.admission_only and v.settings.knobs("summarization").max_waiting == 4
    assert R.reopen_a_shed_queue(r, s, FRESH) is None  # no cooldown: the raise itself comes
    assert R.reopen_a_shed_queue(r, s, State(intervals_since_change=1, intervals_since_scale=1)) is None
    quiet = make_snapshot(
        summarization=dict(tbt_p99=0.05, ttft_p99=40.0, running=2, waiting=2, arrival_rate=0.5)
    )
    assert R.reopen_a_shed_queue(look(quiet, s), s, raised) is None  # nothing rejected


TTFT = make_snapshot(chat=dict(tbt_p99=0.03, ttft_p99=2.5, running=4, arrival_rate=2))


def test_raise_on_slack():
    v = R.raise_on_slack(look(TTFT, start()), start(), FRESH)
    assert v.action == RAISE and v.settings.token_budget == 768 and v.direction == 1, v.reason
    assert R.raise_on_slack(look(TTFT, start()), start(), State(intervals_since_change=1)).action == HOLD
    top = make_config(budget_max=512)
    assert R.raise_on_slack(look(TTFT, start(cfg=top), top), start(cfg=top), FRESH) is None
    tight = make_snapshot(chat=dict(tbt_p99=0.09, ttft_p99=2.5, running=4))
    assert R.raise_on_slack(look(tight, start()), start(), FRESH) is None


def test_hold_for_a_recent_tbt_peak():
    peak = ((("chat", 0.9),),)
    v = R.hold_for_a_recent_tbt_peak(look(TTFT, start(), recent=peak), start(), FRESH)
    assert v.action == HOLD and "no slack within the last 4 intervals" in v.reason
    assert R.hold_for_a_recent_tbt_peak(look(TTFT, start()), start(), FRESH) is None


def test_escalate_under_pressure():
    top = make_config(budget_max=512)
    late = make_snapshot(
        summarization=dict(tbt_p99=0.22, ttft_p99=12.0, running=4, waiting=12, arrival_rate=0.5)
    )
    v = R.escalate_under_pressure(look(late, start(cfg=top), top), start(cfg=top), FRESH)
    assert v.action == SHED and v.settings.knobs("summarization").max_waiting == 16, v.reason
    growing = make_snapshot(
        summarization=dict(tbt_p99=0.22, running=4, waiting=12, waiting_trend=0.5, arrival_rate=0.5)
    )
    v = R.escalate_under_pressure(look(growing, start()), start(), FRESH)
    assert v.action == HOLD and "not shedding" in v.reason  # a growing queue alone never sheds
    assert R.escalate_under_pressure(look(TTFT, start()), start(), FRESH) is None  # TBT slack: raise instead


def test_hold_under_pressure_and_only_under_pressure():
    v = R.hold_under_pressure(look(TTFT, start()), start(), FRESH)
    assert v.action == HOLD and "allows no larger budget" in v.reason
    calm = make_snapshot(chat=dict(tbt_p99=0.03, ttft_p99=0.1, running=4))
    assert R.hold_under_pressure(look(calm, start()), start(), FRESH) is None


# ---- 10-14. lasting slack, caps, hold -------------------------------------------------------------------------
QUIET = make_snapshot(
    chat=dict(tbt_p99=0.01, ttft_p99=0.05, running=1, arrival_rate=0.1, prefill_token_rate=10)
)


def test_give_back_shed_load_running_cap_before_queue_bound():
    s = start().with_knobs("summarization", max_running=2, max_waiting=4)
    v = R.give_back_shed_load(look(QUIET, s), s, SLACK)
    assert (
        v.action == RESTORE and v.settings.knobs("summarization").max_running == 256 and not v.admission_only
    )
    s = start().with_knobs("summarization", max_waiting=4)
    v = R.give_back_shed_load(look(QUIET, s), s, SLACK)
    assert v.settings.knobs("summarization").max_waiting == 8 and v.admission_only
    assert R.give_back_shed_load(look(QUIET, s), s, State(slack_streak=5, intervals_since_scale=9)) is None
    assert R.give_back_shed_load(look(QUIET, start()), start(), SLACK) is None


def test_probe_toward_home():
    cfg = make_config(budget_home=1024)
    v = R.probe_toward_home(look(QUIET, start(256, cfg=cfg), cfg), start(256, cfg=cfg), SLACK)
    assert v.action == RAISE and v.settings.token_budget == 320, v.reason  # +25%, half the pressure step
    assert R.probe_toward_home(look(QUIET, start(1024, cfg=cfg), cfg), start(1024, cfg=cfg), SLACK) is None
    assert R.probe_toward_home(look(QUIET, start(256)), start(256), SLACK) is None  # no home
    assert R.probe_toward_home(look(QUIET, start(256, cfg=cfg), cfg), start(256, cfg=cfg), FRESH) is None
    # TBT slack now but not over the raise memory: no probe, even where the calibrated limit has room.
    fine = make_config(budget_home=1024, align=16)
    r = look(QUIET, start(256, cfg=fine), fine, recent=((("chat", 0.8),),))
    assert r.raise_limit > 256 and R.probe_toward_home(r, start(256, cfg=fine), SLACK) is None


def test_scale_in():
    cfg = make_config(replicas_max=3)
    v = R.scale_in(look(QUIET, start(replicas=3, cfg=cfg), cfg), start(replicas=3, cfg=cfg), SLACK)
    assert v.action == SCALE_IN and v.settings.replicas == 2
    assert R.scale_in(look(QUIET, start(replicas=3, cfg=cfg), cfg), start(replicas=3, cfg=cfg), FRESH) is None
    assert R.scale_in(look(QUIET, start(cfg=cfg), cfg), start(cfg=cfg), SLACK) is None  # at replicas.min
    busy = make_snapshot(chat=dict(tbt_p99=0.01, running=1, arrival_rate=5, prefill_token_rate=50_000))
    assert R.scale_in(look(busy, start(replicas=3, cfg=cfg), cfg), start(replicas=3, cfg=cfg), SLACK) is None


def test_fit_chunk_caps():
    over = start().with_knobs("chat", chunk_cap=4096)
    v = R.fit_chunk_caps(look(QUIET, over), over, FRESH)
    assert v.action == CAP and "within the budget 512" in v.reason
    assert R.fit_chunk_caps(look(QUIET, start()), start(), FRESH) is None


def test_hold_steady_always_decides():
    assert R.hold_steady(look(make_snapshot(), start()), start(), FRESH).reason == "no traffic"
    assert R.hold_steady(look(QUIET, start()), start(), FRESH).reason == "SLOs met"
