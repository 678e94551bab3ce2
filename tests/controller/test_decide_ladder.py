"""The parts the rules share: the escalation ladder, the cost-model sizes, and how a verdict becomes a
decision (the state it leaves)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from controller_factories import make_config, make_snapshot, make_specs

from stallfree.costmodel.model import BUILTIN, LinearCostModel
from stallfree.operator.controller import State
from stallfree.operator.controller.decide import conclude, initial_settings, next_interval
from stallfree.operator.controller.escalation import escalate
from stallfree.operator.controller.reading import read
from stallfree.operator.controller.sizing import (
    admitted_running_cap,
    drain_bound,
    raise_budget,
    running_cap_within_target,
)
from stallfree.operator.controller.types import HOLD, LOWER, RESTORE, SCALE_OUT, SHED
from stallfree.operator.controller.verdict import Verdict, hold

SPECS = make_specs()
CFG = make_config()
FLAT = LinearCostModel(base=0.1, per_prefill=1e-3, per_decode=0.0, per_decode_context=0.0, absolute=True)
DOCS = make_snapshot(
    chat=dict(tbt_p99=0.3, running=2, arrival_rate=1),
    summarization=dict(running=12, waiting=20, arrival_rate=0.5, prefill_token_rate=800, mean_context=1600),
)


def look(snap, s, cfg=CFG, model=BUILTIN):
    return read(snap, s, SPECS, cfg, model)


def start(budget=128, replicas=1, cfg=CFG):
    return initial_settings(SPECS, cfg, budget, replicas)


# ---- the escalation ladder, step by step -------------------------------------------------------------------
def test_the_ladder_waits_out_the_last_scale_then_scales_out():
    cfg = make_config(replicas_max=2)
    s = start(cfg=cfg)
    v = escalate(look(DOCS, s, cfg), s, State(intervals_since_scale=1), "why")
    assert v.action == HOLD and "waiting for the last scale/shed" in v.reason
    v = escalate(look(DOCS, s, cfg), s, State(), "why")
    assert v.action == SCALE_OUT and v.settings.replicas == 2 and v.reason == "why: replicas 1 -> 2"


def test_at_replicas_max_the_ladder_holds_when_shedding_is_not_called_for():
    v = escalate(look(DOCS, start()), start(), State(), "why", may_shed=False)
    assert v.action == HOLD and "not shedding yet" in v.reason


def test_decode_bound_the_ladder_caps_the_lowest_priority_running_set_after_the_cap_cooldown():
    v = escalate(look(DOCS, start()), start(), State(), "why", decode_bound=True)
    assert v.action == SHED and v.who == "summarization" and not v.scale
    assert v.settings.knobs("summarization").max_running == 6  # half of the 12 running
    v = escalate(look(DOCS, start()), start(), State(intervals_since_change=1), "why", decode_bound=True)
    assert v.action == HOLD and "cooling down" in v.reason


def test_otherwise_the_ladder_sheds_the_lowest_priority_queue_bound():
    v = escalate(look(DOCS, start()), start(), State(), "why")
    assert v.action == SHED and v.admission_only and v.settings.knobs("summarization").max_waiting == 16
    # With a trusted model, straight to the queue its capacity share drains within target x TTFT SLO.
    s = initial_settings(SPECS, make_config(budget_min=512, budget_max=512), 512, 1)
    late = make_snapshot(summarization=dict(tbt_p99=0.05, ttft_p99=12.0, running=4, waiting=20, arrival_rate=0.5,
                                            prefill_token_rate=800, mean_context=1600))  # fmt: skip
    v = escalate(look(late, s, make_config(budget_min=512, budget_max=512), FLAT), s, State(), "why")
    assert v.settings.knobs("summarization").max_waiting == 3, v.reason


def test_the_ladder_holds_when_nothing_is_left_to_shed():
    s = start().with_knobs("chat", max_waiting=1).with_knobs("summarization", max_waiting=1)
    v = escalate(look(DOCS, s), s, State(), "why")
    assert v.action == HOLD and "nothing left to shed" in v.reason


# ---- sizes from the cost model -------------------------------------------------------------------------------
def test_a_raise_jumps_to_the_budget_that_serves_modelled_overload():
    model = LinearCostModel(base=0.1, per_prefill=1e-3, per_decode=0.0, per_decode_context=0.0)
    cfg = make_config(budget_max=4096)
    snap = make_snapshot(summarization=dict(tbt_p99=0.05, prefill_token_rate=850, arrival_rate=1, running=1))
    s = start(cfg=cfg)
    r = look(snap, s, cfg, model)
    assert r.overloaded and raise_budget(r, s) > 128 * 1.5
    calm = look(make_snapshot(chat=dict(tbt_p99=0.01, ttft_p99=5, running=1)), s, cfg, model)
    assert raise_budget(calm, s) == 192  # +50%


def test_one_step_sizes_need_a_model_trusted_in_absolute_terms():
    s = start()
    assert drain_bound(look(DOCS, s), s, "summarization") is None
    assert running_cap_within_target(look(DOCS, s), s, "summarization", 6, 128) == 6
    assert drain_bound(look(DOCS, s, model=FLAT), s, "summarization") is not None


def test_a_running_cap_doubles_back_only_while_the_model_admits_it():
    queued = make_snapshot(
        chat=dict(tbt_p99=0.075, running=4),
        summarization=dict(running=4, waiting=30, tbt_p99=0.1, arrival_rate=0.5, mean_context=600),
    )
    s = start(512).with_knobs("summarization", max_running=4)
    roomy = LinearCostModel(base=0.02, per_prefill=1e-5, per_decode=5e-4, per_decode_context=0.0)
    assert admitted_running_cap(look(queued, s, model=roomy), s, "summarization", 256) == 8
    heavy = LinearCostModel(base=0.02, per_prefill=1e-5, per_decode=0.05, per_decode_context=0.0)
    assert admitted_running_cap(look(queued, s, model=heavy), s, "summarization", 256) is None


# ---- verdict -> decision, and the state between intervals ----------------------------------------------------
def test_a_queue_bound_leaves_the_budgets_cooldown_running():
    s, st = start(), State(intervals_since_change=3, intervals_since_scale=3, slack_streak=2)
    r = look(DOCS, s)
    d = conclude(
        Verdict(s.with_knobs("chat", max_waiting=8), SHED, "x", who="chat", admission_only=True), r, st
    )
    assert (d.state.intervals_since_change, d.state.intervals_since_scale, d.state.slack_streak) == (3, 0, 0)
    assert d.cluster_actions == {"chat": SHED}
    d = conclude(Verdict(s, SHED, "cap", who="chat", scale=False), r, st)
    assert (d.state.intervals_since_change, d.state.intervals_since_scale) == (0, 3)


def test_a_cut_records_its_direction_and_aim_and_a_hold_changes_nothing():
    s, st = start(512), State(intervals_since_change=3, slack_streak=2)
    r = look(DOCS, s)
    d = conclude(Verdict(replace(s, token_budget=256), LOWER, "cut", direction=-1, cut_slo=0.1), r, st)
    assert (d.state.last_direction, d.state.cut_slo, d.state.intervals_since_change) == (-1, 0.1, 0)
    assert all(d.settings.knobs(n).chunk_cap <= 256 for n in ("chat", "summarization"))  # caps follow
    assert d.cluster_actions == {"chat": LOWER, "summarization": LOWER}
    assert conclude(hold(s, "wait"), r, st).state == st


def test_each_interval_counts_cooldowns_forward_and_remembers_tbt_for_raises():
    cfg = make_config(raise_memory=2)
    s = start(cfg=cfg)
    before = ((("chat", 0.5),),) * 2
    st = State(intervals_since_change=0, intervals_since_scale=5, slack_streak=3, recent_tbt=before)
    n = next_interval(st, look(DOCS, s, cfg))  # chat at 3x its TBT SLO: no slack
    assert (n.intervals_since_change, n.intervals_since_scale, n.slack_streak) == (1, 6, 0)
    assert len(n.recent_tbt) == 2 and dict(n.recent_tbt[-1])["chat"] == pytest.approx(3.0)
    quiet = look(make_snapshot(chat=dict(tbt_p99=0.01, running=1)), s, cfg)
    assert next_interval(st, quiet).slack_streak == 4
    assert conclude(Verdict(s, RESTORE, "x", who="chat"), quiet, st).state.intervals_since_scale == 0
