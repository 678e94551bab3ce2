"""The control step's status conditions: missing metrics and refused settings are told apart, and both
hold the last good settings. The source and applier are plain objects (no I/O is under test here)."""

from __future__ import annotations

from controller_factories import make_config, make_snapshot, make_specs

from stallfree.operator.controller.applier import ApplyFailed
from stallfree.operator.controller.loop import ControlLoop
from stallfree.operator.controller.prometheus import MetricsUnavailable
from stallfree.operator.controller.types import State
from stallfree.operator.status import controller_status


class Source:
    def __init__(self) -> None:
        self.down = False

    def snapshot(self, window_s, clusters):
        if self.down:
            raise MetricsUnavailable("Prometheus at http://p:9090 did not answer")
        return make_snapshot(chat=dict(tbt_p99=0.5, running=8))  # 5x chat's TBT SLO: lower the budget


class Applier:
    def __init__(self) -> None:
        self.refuse: str | None = None
        self.applied = []

    def __call__(self, settings) -> None:
        if self.refuse:
            raise ApplyFailed(self.refuse)
        self.applied.append(settings)


def conditions(loop: ControlLoop) -> dict[str, dict]:
    return {c["type"]: c for c in controller_status(loop)["conditions"]}


def make_loop(**cfg):
    src, app = Source(), Applier()
    loop = ControlLoop.start(
        make_specs(), make_config(**cfg), 1024, 1, source=src, apply=app, clock=lambda: 100.0
    )
    loop.state = State()  # no restart cooldown: act on the first step
    return loop, src, app


def test_refused_settings_are_an_apply_failure_not_missing_metrics():
    loop, _, app = make_loop()
    app.refuse = "engine-0: HTTP 503"
    step = loop.step()
    assert step.holding and loop.settings.token_budget == 1024  # held, nothing changed
    c = conditions(loop)
    assert c["MetricsAvailable"]["status"] == "True"
    assert c["SettingsApplied"]["status"] == "False" and c["SettingsApplied"]["reason"] == "ApplyFailed"
    assert "HTTP 503" in c["SettingsApplied"]["message"]
    app.refuse = None
    step = loop.step()
    assert not step.holding and loop.settings.token_budget < 1024 and app.applied
    assert conditions(loop)["SettingsApplied"]["status"] == "True"


def test_missing_metrics_hold_and_say_so():
    loop, src, app = make_loop()
    src.down = True
    step = loop.step()
    assert step.holding and not app.applied
    c = conditions(loop)
    assert c["MetricsAvailable"]["status"] == "False" and c["MetricsAvailable"]["reason"] == "HoldingSettings"
    assert "did not answer" in c["MetricsAvailable"]["message"]
    assert c["SettingsApplied"]["status"] == "True"


def test_a_first_start_acts_at_once_and_a_restart_waits_out_the_cooldowns():
    """adopt() with the spec's own settings in force (nothing tuned yet) drops the start-up cooldowns, so
    a TBT violation is met on the first step; tuned settings keep them (a restarted controller holds)."""
    first, _, app = make_loop(shrink_cooldown=3, scale_cooldown=3)  # as local mode stretches them
    first.state = State(intervals_since_change=0, intervals_since_scale=0)  # as a new loop starts
    first.adopt(first.settings)
    step = first.step()
    assert step.action == "lower" and first.settings.token_budget < 1024, step.reason
    restarted, _, _ = make_loop(shrink_cooldown=3, scale_cooldown=3)
    restarted.state = State(intervals_since_change=0, intervals_since_scale=0)
    restarted.adopt(first.settings)  # tuned: below the spec's 1024
    step = restarted.step()
    assert step.action == "hold" and restarted.settings == first.settings, step.reason
