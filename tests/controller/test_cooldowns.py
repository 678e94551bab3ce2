"""The cooldowns are declared once (operator/controller/cooldowns.py) and every rule that waits uses them.

Each rule that waits is run on both sides of its cooldown's declared length, and again with only that
config field moved: a rule that compared a counter with a length of its own would not follow. The source
check then finds no other module that reads a cooldown counter or length itself.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import pytest
from controller_factories import CHAT_SLO, make_config, make_snapshot, make_specs

from stallfree.costmodel.model import BUILTIN, LinearCostModel
from stallfree.operator.controller import State
from stallfree.operator.controller import cooldowns as C
from stallfree.operator.controller import rules as R
from stallfree.operator.controller.decide import initial_settings
from stallfree.operator.controller.escalation import escalate
from stallfree.operator.controller.reading import read
from stallfree.operator.controller.types import (
    HOLD,
    LOWER,
    RAISE,
    RESTORE,
    SCALE_IN,
    SCALE_OUT,
    SHED,
    ControllerConfig,
)

SPECS = make_specs()
LENGTH = 3  # every cooldown under test is this many intervals long
ROOMY = LinearCostModel(base=0.02, per_prefill=1e-5, per_decode=5e-4, per_decode_context=0.0)
STALL = make_snapshot(chat=dict(tbt_p99=0.2, running=8))  # chat at 2x its TBT SLO
TTFT = make_snapshot(chat=dict(tbt_p99=0.03, ttft_p99=2.5, running=4, arrival_rate=2))
QUEUED = dict(running=4, waiting=30, ttft_p99=25.0, tbt_p99=0.1, arrival_rate=0.5, mean_context=600)
REJECTING = make_snapshot(
    summarization=dict(
        tbt_p99=0.05, ttft_p99=40.0, running=2, waiting=2, arrival_rate=0.5, rejection_rate=0.3
    )
)
DOCS = make_snapshot(
    chat=dict(tbt_p99=0.3, running=2, arrival_rate=1),
    summarization=dict(running=12, waiting=20, arrival_rate=0.5, prefill_token_rate=800, mean_context=1600),
)
QUIET = make_snapshot(
    chat=dict(tbt_p99=0.01, ttft_p99=0.05, running=1, arrival_rate=0.1, prefill_token_rate=10)
)
Run = Callable[[ControllerConfig, State], object]


def _rule(rule, snap, settings, model=BUILTIN, **cfg_kw) -> Callable[[ControllerConfig], Run]:
    """A rule on one snapshot; settings(cfg) gives the settings in force."""

    def with_cfg(cfg: ControllerConfig) -> Run:
        cfg = replace(cfg, **cfg_kw)
        s = settings(cfg)
        return lambda _, st: rule(read(snap, s, SPECS, cfg, model), s, st)

    return with_cfg


def _start(budget=512, replicas=1, **knobs):
    def settings(cfg):
        s = initial_settings(SPECS, cfg, budget, replicas)
        for name, kw in knobs.items():
            s = s.with_knobs(name, **kw)
        return s

    return settings


def _escalate(snap, settings, **kw):
    return _rule(lambda r, s, st: escalate(r, s, st, "why", **kw), snap, settings, replicas_max=2)


# (cooldown, the rule, the state besides the counter, what it does while cooling, what it does after).
# A verdict is named by its action; None: the rule passes.
CASES = [
    pytest.param(C.SHRINK, _rule(R.cut_on_tbt_violation, STALL, _start()),
                 State(last_direction=-1, cut_slo=CHAT_SLO.tbt_p99), HOLD, LOWER, id="shrink-cut"),
    pytest.param(C.GROW, _rule(R.raise_on_slack, TTFT, _start()), State(), HOLD, RAISE, id="grow-raise"),
    pytest.param(C.GROW, _rule(R.restore_running_cap_under_pressure,
                               make_snapshot(chat=dict(tbt_p99=0.075, running=4), summarization=QUEUED),
                               _start(summarization=dict(max_running=4)), ROOMY),
                 State(), HOLD, RESTORE, id="grow-restore-running-cap"),
    pytest.param(C.GROW, _rule(R.reopen_a_shed_queue, REJECTING, _start(128, summarization=dict(max_waiting=2))),
                 State(last_direction=1), RESTORE, None, id="grow-reopen-only-while-a-raise-waits"),
    pytest.param(C.SCALE, _rule(R.reopen_a_shed_queue, REJECTING, _start(128, summarization=dict(max_waiting=2)),
                                grow_cooldown=1000),
                 State(intervals_since_change=0, last_direction=1), None, RESTORE, id="scale-reopen"),
    pytest.param(C.SCALE, _escalate(DOCS, _start(128)), State(), HOLD, SCALE_OUT, id="scale-ladder"),
    pytest.param(C.CAP, _escalate(DOCS, _start(128, 2), decode_bound=True), State(), HOLD, SHED,
                 id="cap-running-set"),
    pytest.param(C.SCALE, _rule(R.give_back_shed_load, QUIET, _start(summarization=dict(max_waiting=4))),
                 State(slack_streak=6), None, RESTORE, id="scale-give-back"),
    pytest.param(C.SCALE, _rule(R.scale_in, QUIET, _start(replicas=3), replicas_max=3),
                 State(slack_streak=6), None, SCALE_IN, id="scale-in"),
]  # fmt: skip


def _did(verdict) -> str | None:
    return None if verdict is None else verdict.action


@pytest.mark.parametrize("cd, make_run, base, cooling, after", CASES)
def test_each_waiting_rule_follows_its_declared_cooldown(cd, make_run, base, cooling, after):
    cfg = make_config(**{cd.length: LENGTH})
    run = make_run(cfg)
    inside = replace(base, **{cd.since: LENGTH - 1})
    v = run(cfg, inside)
    assert _did(v) == cooling, v
    if cooling == HOLD:
        assert v.reason.endswith(f"; {cd.why}"), v.reason  # the declared reason, not one of its own
    assert _did(run(cfg, replace(base, **{cd.since: LENGTH}))) == after
    # Only the declared length moves the threshold: one interval shorter, the same state is past it.
    shorter = make_config(**{cd.length: LENGTH - 1})
    assert _did(make_run(shorter)(shorter, inside)) == after


def test_every_declared_cooldown_is_exercised_above():
    assert {p.values[0] for p in CASES} == set(C.COOLDOWNS)


def test_declarations_name_real_fields():
    state_fields = {f.name for f in fields(State)}
    config_fields = {f.name for f in fields(ControllerConfig)}
    for cd in C.COOLDOWNS:
        assert cd.since in C.COUNTERS and cd.since in state_fields
        assert cd.length in config_fields and isinstance(getattr(ControllerConfig(), cd.length), int)
    with pytest.raises(ValueError, match="not a ControllerConfig field"):
        C.Cooldown("typo", C.SINCE_CHANGE, "grow_coldown", "x")
    with pytest.raises(ValueError, match="not a State counter"):
        C.Cooldown("typo", "slack_streak", "grow_cooldown", "x")


def test_counters_tick_restart_and_start():
    st = State(intervals_since_change=2, intervals_since_scale=5, slack_streak=3)
    assert C.tick(st) == replace(st, intervals_since_change=3, intervals_since_scale=6)
    assert C.restart(st, change=True, scale=False) == replace(st, intervals_since_change=0)
    assert C.restart(st, change=False, scale=True) == replace(st, intervals_since_scale=0)
    assert C.restart(st, change=False, scale=False) == st
    waiting = C.all_pending(st)
    assert all(C.cooling(cd, waiting, ControllerConfig()) for cd in C.COOLDOWNS)
    assert waiting.slack_streak == 3
    assert not any(C.cooling(cd, C.none_pending(waiting), ControllerConfig()) for cd in C.COOLDOWNS)


# ---- declared once: nothing else reads a counter or a length ---------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
DECLARED_IN = {"cooldowns.py", "types.py"}  # the declarations, and the fields they name
COUNTERS = set(C.COUNTERS)
LENGTHS = {cd.length for cd in C.COOLDOWNS}


def _touches(path: Path) -> list[str]:
    """Reads of a counter or a length (`st.intervals_since_change`, `cfg.grow_cooldown`) and counters set
    by keyword (`replace(st, intervals_since_scale=0)`). A length given by keyword is configuration (the
    edge choosing it, as local mode does), not a rule waiting on its own."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in COUNTERS | LENGTHS:
            hits.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in COUNTERS:
            hits.append(f"{path.name}:{node.lineno}: {node.arg}=")
    return hits


def test_no_module_but_cooldowns_reads_a_counter_or_a_length(tmp_path):
    files = [
        *sorted((ROOT / "operator" / "controller").glob("*.py")),
        *sorted((ROOT / "stallfree" / "local").glob("*.py")),
    ]
    assert len(files) > 10
    assert [h for f in files if f.name not in DECLARED_IN for h in _touches(f)] == []
    # The check can fail: it finds a rule that waits on its own, and a state it restarts by hand.
    own = tmp_path / "rule.py"
    own.write_text(
        "def r(st, cfg):\n"
        "    if st.intervals_since_change < cfg.grow_cooldown:\n"
        "        return replace(st, intervals_since_scale=0)\n"
        "    return ControllerConfig(grow_cooldown=3)\n"
    )
    assert _touches(own) == ["rule.py:2: .intervals_since_change", "rule.py:2: .grow_cooldown",
                             "rule.py:3: intervals_since_scale="]  # fmt: skip
